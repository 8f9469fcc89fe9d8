"""Django project of the control plane (settings, urls, ASGI app) and its apps."""
