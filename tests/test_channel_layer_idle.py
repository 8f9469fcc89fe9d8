"""The channel layer survives idle periods (issue: the run page's websocket dropped every 5-10 s).

Root cause, confirmed on the pinned versions: redis-py 8 gives every connection a 5 s socket read
timeout (``redis._defaults.DEFAULT_SOCKET_TIMEOUT``), and channels-redis receives with a blocking
``BZPOPMIN`` of ``brpop_timeout`` = 5 s. On an idle channel the server answers the pop after 5 s, the
client's read gives up after 5 s, and whichever comes first decides: often the read, which raises
``redis.exceptions.TimeoutError`` inside the consumer and closes the browser's socket.

Real Redis, the project's real ``CHANNEL_LAYERS`` setting; no fakes.
"""

from __future__ import annotations

import asyncio

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings


def _layer():
    """A fresh layer from the settings (the cached default may be bound to another event loop)."""
    from channels.layers import channel_layers

    return channel_layers.make_backend("default")


def test_socket_read_timeout_outlasts_the_blocking_pop():
    layer = _layer()
    timeout = settings.GRPO_CHANNEL_SOCKET_TIMEOUT_S
    assert timeout is None or timeout > layer.brpop_timeout + 1, (timeout, layer.brpop_timeout)

    async def pool_timeout():
        client = layer.connection(0)
        try:
            return client.connection_pool.connection_kwargs.get("socket_timeout")
        finally:
            await client.aclose(close_connection_pool=True)

    # What the connections are really built with (not only what the setting says).
    assert async_to_sync(pool_timeout)() == timeout


def test_idle_receive_spans_several_blocking_pops():
    """A receiver left idle for three pop cycles gets the message that arrives afterwards.

    Before the fix this raised ``redis.exceptions.TimeoutError`` in most runs (each 5 s cycle lost the
    race about half the time).
    """
    layer = _layer()
    assert get_channel_layer() is not None
    idle_s = 3 * layer.brpop_timeout + 1

    async def scenario():
        channel = await layer.new_channel()

        async def send_later():
            await asyncio.sleep(idle_s)
            await layer.send(channel, {"type": "probe", "n": 1})

        sender = asyncio.create_task(send_later())
        try:
            return await asyncio.wait_for(layer.receive(channel), timeout=idle_s + 20)
        finally:
            await sender
            await layer.flush()

    message = async_to_sync(scenario)()
    assert message == {"type": "probe", "n": 1}


def test_this_session_has_its_own_channel_prefix():
    """The layer the tests use is the one their subprocesses get (the environment's prefix)."""
    import os

    assert settings.GRPO_CHANNEL_PREFIX == os.environ["GRPO_CHANNEL_PREFIX"] != "asgi"
    assert _layer().prefix == settings.GRPO_CHANNEL_PREFIX
