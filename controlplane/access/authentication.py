"""DRF authentication by API token: ``Authorization: Token <key>`` (keys stored hashed)."""

from __future__ import annotations

from rest_framework import authentication, exceptions

from controlplane.access.services import token_user


class ApiTokenAuthentication(authentication.BaseAuthentication):
    keyword = "Token"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].lower() != self.keyword.lower().encode():
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("Invalid token header: use 'Authorization: Token <key>'.")
        try:
            key = header[1].decode()
        except UnicodeError:
            raise exceptions.AuthenticationFailed("Invalid token header: the key is not text.") from None
        user = token_user(key=key)
        if user is None:
            raise exceptions.AuthenticationFailed("Invalid or revoked token.")
        return user, key

    def authenticate_header(self, request) -> str:
        return self.keyword
