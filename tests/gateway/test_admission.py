"""Admission: a tenant (its namespace) may have at most `max_turns_per_tenant` turns in
flight at a gateway, whatever its prompts' form (token ids skip the tokenizer pool, not
this bound); past it, RESOURCE_EXHAUSTED on gRPC and 429 on HTTP, saying which limit and
its flag. Other tenants are not held back, and the tenant may send again once a turn ends.
"""

from __future__ import annotations

import grpc
import httpx
import numpy as np

from prefixgate.security.auth import AuthConfig, hash_token, new_token
from prefixgate.v1 import chat_pb2, chat_pb2_grpc, common_pb2
from prefixgate.wire.protocol import RequestLimits
from prefixgate.wire.rpc import free_port
from tests.helpers import start_emulated_worker, start_gateway, wait_for


def test_a_tenant_past_its_turns_in_flight_is_refused(loop_thread, tiny_spec, tmp_path) -> None:
    acme, globex = new_token(), new_token()
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{hash_token(acme)} acme\n{hash_token(globex)} globex\n")
    # An emulated worker decodes at 30 ms a token: 1,000 tokens hold a turn for 30 s.
    w, wstop, _ = start_emulated_worker(loop_thread, tiny_spec, "adm0")
    http_port = free_port()
    gw, gstop = start_gateway(loop_thread, tiny_spec, [w], http_port=http_port,
                              auth=AuthConfig(tokens_file=str(tokens)),
                              limits=RequestLimits(max_turns_per_tenant=2))
    base = f"http://127.0.0.1:{http_port}"

    def auth(token: str) -> dict:
        return {"Authorization": f"Bearer {token}"}

    long = {"model": tiny_spec.name, "prompt": [5] * 40, "max_tokens": 1000, "stream": True}
    short = {"model": tiny_spec.name, "prompt": [6] * 40, "max_tokens": 2}
    try:
        wait_for(lambda: httpx.get(base + "/health").status_code == 200, what="a worker")
        with httpx.Client(base_url=base, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=long, headers=auth(acme)) as s1, \
                    c.stream("POST", "/v1/completions", json=long, headers=auth(acme)) as s2:
                assert s1.status_code == s2.status_code == 200  # both turns are running
                r = c.post("/v1/completions", json=short, headers=auth(acme))
                error = r.json()["error"]
                assert r.status_code == 429 and error["code"] == "resource_exhausted", error
                assert "--max-turns-per-tenant" in error["message"] and \
                    "'acme'" in error["message"], error
                # gRPC, a packed token-id prompt: the same bound, the same message.
                with grpc.insecure_channel(gw) as ch:
                    call = chat_pb2_grpc.ChatServiceStub(ch).Chat(chat_pb2.ChatRequest(
                        packed_prompt_token_ids=np.asarray([7] * 40, "<u4").tobytes(),
                        sampling=common_pb2.SamplingParams(max_tokens=2)),
                        metadata=(("authorization", f"Bearer {acme}"),), timeout=30)
                    try:
                        list(call)
                        raise AssertionError("a third turn of acme's was let in")
                    except grpc.RpcError as exc:
                        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                        assert exc.details() == error["message"]
                # Another tenant is not held back by acme's turns.
                assert c.post("/v1/completions", json=short,
                              headers=auth(globex)).status_code == 200
            # The streams closed, their turns ended: acme may send again.
            wait_for(lambda: c.post("/v1/completions", json=short,
                                    headers=auth(acme)).status_code == 200,
                     what="acme's turns to end")
    finally:
        for stop in (gstop, wstop):
            loop_thread.loop.call_soon_threadsafe(stop.set)
