"""How this project starts its ASGI web server: daphne, through ``python -m controlplane.core.web_server``
(daphne's own command line, plus one protocol option daphne does not expose). One argument list for
``make run`` (``runstack``) and the test suite's daphne; docker-compose's web service runs the same module.
"""

from __future__ import annotations

__all__ = ["daphne_args"]


def daphne_args(
    *, host: str, port: int, max_frame_bytes: int | None = None, handshake_timeout_s: int | None = None
) -> list[str]:
    """The arguments after ``python`` that serve ``controlplane.asgi`` on ``host:port``.

    The websocket message and frame limits are ``max_frame_bytes`` (``GRPO_WS_MAX_FRAME_BYTES``), so
    daphne's protocol layer (autobahn) closes the socket of an oversized frame with 1009 (message too
    big) itself. The consumer's own check could not: autobahn refuses 1009 from an application as an
    invalid close code (the socket ended with 1011), and from 1 MiB, daphne's default limit, frames
    were dropped with no close at all (issue 29 item 3). A handshake may take ``handshake_timeout_s``
    (``GRPO_WS_HANDSHAKE_TIMEOUT_S``) before daphne resets the connection. Either left out: the setting.
    """
    from django.conf import settings

    size = str(int(settings.GRPO_WS_MAX_FRAME_BYTES if max_frame_bytes is None else max_frame_bytes))
    if handshake_timeout_s is None:
        handshake_timeout_s = settings.GRPO_WS_HANDSHAKE_TIMEOUT_S
    return [
        "-m", "controlplane.core.web_server", "-b", host, "-p", str(port),
        "--websocket-max-message-size", size, "--websocket-max-frame-size", size,
        "--websocket_connect_timeout", str(int(handshake_timeout_s)),
        "controlplane.asgi:application",
    ]  # fmt: skip


def main() -> None:
    """Serve as daphne's command line does, with one protocol option daphne does not expose.

    autobahn's default (``failByDrop``) ends a protocol violation by dropping the TCP connection: a
    client whose frame was over the limit saw the socket vanish (1006) and could not tell why. With
    ``failByDrop`` off it gets a close frame and reads 1009. daphne is imported here, not at the top:
    importing ``daphne.server`` installs Twisted's reactor, which only the server process wants.
    """
    from daphne.cli import CommandLineInterface
    from daphne.server import Server

    class CleanCloseServer(Server):
        def listen_success(self, port) -> None:
            # Protocols copy the factory's options when they connect: set before the first one.
            self.ws_factory.setProtocolOptions(failByDrop=False)
            super().listen_success(port)

    class WebServerCommandLine(CommandLineInterface):
        server_class = CleanCloseServer

    WebServerCommandLine.entrypoint()


if __name__ == "__main__":
    main()
