"""Project-wide pages (home, health) and operational commands (runstack)."""
