"""The per-namespace cache_salt a vLLM adapter sends: keyed, so that another client of
the same vLLM server cannot compute a tenant's salt from its name (and read its cache
hits back through `cached_tokens`); the same at every gateway given the gateways' shared
key; mapped back from vLLM's events to the namespace."""

from __future__ import annotations

import hashlib

import xxhash

from prefixgate.engines.vllm import VLLMConfig, VLLMWorker, cache_salt, cache_salt_key
from prefixgate.engines.vllm_events import decode_batch
from prefixgate.model.tokenizer import ChatTokenizer
from prefixgate.radix import BlockHasher
from prefixgate.security.identity import Keyring, new_gateway_key, new_worker_key
from prefixgate.v1 import common_pb2
from prefixgate.wire.protocol import sampling_from_proto
from prefixgate.workerapi.server import WorkerConfig
from tests.engines.vllm_wire import encode, stored_chain

SERVER = "http://127.0.0.1:9,tcp://127.0.0.1:9"


def _adapter(spec, salt_key: bytes = b"") -> VLLMWorker:
    return VLLMWorker(spec, ChatTokenizer(spec), WorkerConfig("v", block_size=16),
                      VLLMConfig.parse(SERVER, salt_key=salt_key))


def _salt_sent(w: VLLMWorker, namespace: str) -> str:
    return w._body([1, 2, 3], _sampling(), namespace)["cache_salt"]


def _sampling():
    return sampling_from_proto(common_pb2.SamplingParams(max_tokens=4), 3, 4096, "fail")


def test_the_salt_cannot_be_computed_from_the_name(tiny_spec) -> None:
    a, b = _adapter(tiny_spec), _adapter(tiny_spec)
    salt = _salt_sent(a, "acme")
    # Two processes without a configured key: each its own random key, so the name alone
    # determines nothing; none of the unkeyed digests of the name is it.
    assert salt != _salt_sent(b, "acme")
    name = b"acme"
    assert salt not in {"prefixgate-" + xxhash.xxh3_128_hexdigest(name),
                        "prefixgate-" + hashlib.sha256(name).hexdigest()[:32],
                        "prefixgate-" + hashlib.sha256(name).hexdigest()}
    assert len(salt) <= 128 and not set(salt) & set("/@\\")
    assert repr(b"x" * 32) not in repr(VLLMConfig.parse(SERVER, salt_key=b"x" * 32))


def test_gateways_sharing_the_key_salt_alike_and_events_map_back(tiny_spec, tmp_path) -> None:
    path = tmp_path / "gateway.keyring"  # a gateway's --worker-keyring
    path.write_text(f"{new_gateway_key()}\n{new_worker_key('w0')[1]}\n")
    gateway_key = Keyring.from_file(path).gateway_key
    key = cache_salt_key(gateway_key)
    assert key != gateway_key and len(key) == 32
    one, two = _adapter(tiny_spec, key), _adapter(tiny_spec, key)
    salt = _salt_sent(one, "acme")
    assert salt == _salt_sent(two, "acme") == cache_salt(key, "acme")
    assert salt != cache_salt(cache_salt_key(b"another deployment's key"), "acme")
    assert salt != _salt_sent(one, "other")
    # vLLM's events carry the salt: the chain is placed under the namespace.
    tokens = list(range(64))
    one.mapper.apply(decode_batch(encode([stored_chain(tokens, 16, 0, 4, salt=salt)]))[1])
    assert one.mapper.held_prefix_blocks(BlockHasher(16, tiny_spec.fingerprint, "acme")
                                         .hash_blocks(tokens)) == 4
    # The other adapter never sent it (no turn of "acme" there yet): not placed anywhere.
    two._salts.clear()
    two.mapper.apply(decode_batch(encode([stored_chain(tokens, 16, 0, 4, salt=salt)]))[1])
    assert two.mapper.num_held_blocks == 0 and two.mapper.num_foreign_blocks == 4


def test_the_gateway_keys_its_vllm_adapters_with_the_gateways_key(tiny_spec, tmp_path) -> None:
    """`prefixgate gateway --vllm-worker ... --worker-keyring FILE`: the adapters' salt key
    is derived from FILE's '@gateways' line; without one each adapter has its own."""
    import asyncio

    from prefixgate.gateway.server import GatewayConfig, _start_vllm_workers
    from prefixgate.registry import make_registry
    from prefixgate.security.auth import AuthConfig

    path = tmp_path / "gateway.keyring"
    path.write_text(f"{new_gateway_key()}\n{new_worker_key('w0')[1]}\n")
    servers = ("http://127.0.0.1:9,tcp://127.0.0.1:9", "http://127.0.0.2:9,tcp://127.0.0.2:9")

    async def salt_keys(auth: AuthConfig) -> list[bytes]:
        local = await _start_vllm_workers(tiny_spec, ChatTokenizer(tiny_spec),
                                          make_registry(None),
                                          GatewayConfig(vllm_workers=servers, auth=auth))
        try:
            return [w.service._salt_key for w in local.values()]
        finally:
            await asyncio.gather(*(w.service.close() for w in local.values()))

    keyed = asyncio.run(salt_keys(AuthConfig(worker_keyring_file=str(path))))
    assert keyed == [cache_salt_key(Keyring.from_file(path).gateway_key)] * 2
    own = asyncio.run(salt_keys(AuthConfig()))
    assert len(set(own)) == 2 and not set(own) & set(keyed)
