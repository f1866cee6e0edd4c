"""Cluster authentication's parts that need no worker (issue 13): the private Redis refuses
clients without its password, and a server's nonce cache refuses replays within the token
window, forgets them after it, and fails closed when full. The attacks on real workers are
``test_cluster_auth.py``'s.
"""

from __future__ import annotations

import pytest
import redis

from pdserve.cluster.auth import NonceCache, RpcToken
from pdserve.entrypoints.redis_server import RedisServer


def test_the_private_redis_refuses_clients_without_its_password():
    with RedisServer() as server:
        assert redis.Redis.from_url(server.url).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host=server.host, port=server.port).ping()
        assert server.password not in server.display_url


def test_the_nonce_cache_forgets_what_left_the_window_and_is_bounded():
    """A server's memory of nonces: a nonce is refused again until its token's time
    leaves the window, then dropped; a full cache refuses new nonces (fails closed)."""
    cache = NonceCache(window_s=60, max_size=3)
    t = 1_000_000.0
    tokens = [RpcToken(int(t), f"{i:032x}", "stream") for i in range(4)]
    assert cache.add(tokens[0], now=t) is None
    assert "replayed" in cache.add(tokens[0], now=t + 59)
    assert cache.add(tokens[1], now=t) is None and cache.add(tokens[2], now=t) is None
    assert "too many" in cache.add(tokens[3], now=t + 1)
    assert cache.add(tokens[3], now=t + 61) is None  # the others expired, and are gone
    assert len(cache) == 1
