"""SGLangDistributedReceiver's sender side for real: this process (the trainer, its job's default group up) opens
the weight-update group and broadcasts each bucket, and a second process plays the engine's side with what
sglang 0.5.23 runs there (copied from its source: ``init_custom_process_group``, the worker's
``update_weights_from_distributed`` receive loop), behind an engine with ``sglang.Engine``'s signatures. gloo on
CPU; NCCL and a real SGLang engine wait for a GPU (docs/rl.md)."""

import datetime
import io
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from twinkle_strategy.rl.engines.sglang_distributed import SGLangDistributedReceiver
from twinkle_strategy.rl.engines.sglang_http import SGLangHTTPEngine
from twinkle_strategy.rl.weight_export import Bucket, TensorMeta

TIMEOUT = datetime.timedelta(seconds=20)


def init_custom_process_group(backend, init_method, world_size, rank, group_name, timeout=TIMEOUT):
    """sglang.srt.utils.common.init_custom_process_group (0.5.23), the arguments its worker passes."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      backend_options=None, timeout=timeout, device_id=None)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class EngineSide:
    """What sglang 0.5.23's model runner does for each request (its WeightUpdater), tp_rank 0, on CPU."""

    def __init__(self, refuse: str | None):
        self.groups, self.received, self.refuse, self.flushes = {}, [], refuse, 0

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                  backend="nccl"):
        self.groups[group_name] = init_custom_process_group(backend, f"tcp://{master_address}:{master_port}",
                                                            world_size, rank_offset + 0, group_name)
        return True, "Succeeded to initialize custom process group."

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        flush_cache=True, load_format=None):
        assert flush_cache is False and load_format is None
        weights, handles = [], []
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            weight = torch.empty(shape, dtype=getattr(torch, dtype), device="cpu")
            handles.append(dist.broadcast(weight, src=0, group=self.groups[group_name], async_op=True))
            weights.append((name, weight))
        for handle in handles:
            handle.wait()
        if self.refuse in names:  # the model's load_weights failing, as the worker reports it
            return False, f"Failed to update parameter online: no parameter {self.refuse}."
        self.received += weights
        return True, "Succeeded to update parameter online."

    def flush_cache(self):
        self.flushes += 1
        return type("FlushCacheReqOutput", (), {"success": True})()


def engine_process(conn, refuse):
    side = EngineSide(refuse)
    while (request := conn.recv()) is not None:
        method, kwargs = request
        result = getattr(side, method)(**kwargs)
        conn.send(tuple(result) if isinstance(result, tuple) else {"success": result.success})
    saved = io.BytesIO()  # as bytes: a tensor sent over the pipe would be shared memory that ends with this process
    torch.save(side.received, saved)
    conn.send((saved.getvalue(), side.flushes))


class SGLangEngineSignatures:
    """sglang.Engine's three methods, as 0.5.23 declares them, forwarding to the engine process (the Engine's
    scheduler is another process too)."""

    def __init__(self, conn):
        self.conn, self.calls = conn, []

    def _call(self, method, **kwargs):
        self.calls.append(method)
        self.conn.send((method, kwargs))
        answer = self.conn.recv()
        return type("Out", (), answer)() if isinstance(answer, dict) else answer

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str = "nccl"):
        return self._call("init_weights_update_group", master_address=master_address, master_port=master_port,
                          rank_offset=rank_offset, world_size=world_size, group_name=group_name, backend=backend)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        load_format: str | None = None):
        return self._call("update_weights_from_distributed", names=names, dtypes=dtypes, shapes=shapes,
                          group_name=group_name, flush_cache=flush_cache, load_format=load_format)

    def flush_cache(self):
        return self._call("flush_cache")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def buckets():
    torch.manual_seed(0)
    tensors = [("model.embed_tokens.weight", torch.randn(8, 4)), ("model.norm.weight", torch.randn(4)),
               ("lm_head.weight", torch.randn(8, 4, dtype=torch.bfloat16)),
               ("model.layers.0.mlp.experts.gate_up_proj", torch.randn(2, 3, 5, dtype=torch.float16))]
    return [Bucket(0, 0, tensors[:2], 144), Bucket(1, 0, tensors[2:], 124)]


def export(receiver, bs):
    receiver.prepare([TensorMeta(k, tuple(v.shape), v.dtype) for b in bs for k, v in b.tensors])
    for bucket in bs:
        receiver(bucket)
    receiver.finish()


@pytest.fixture()
def engine():
    """The engine process and its client; yields (client, a function that ends it and returns what it received)."""
    started = not dist.is_initialized()
    if started:  # the trainer's job group: the weight-update group is made beside it
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    context, processes = mp.get_context("spawn"), []

    def start(refuse=None):
        ours, theirs = context.Pipe()
        process = context.Process(target=engine_process, args=(theirs, refuse), daemon=True)
        process.start()
        processes.append(process)

        def end():
            ours.send(None)
            saved, flushes = ours.recv()
            process.join(timeout=20)
            return torch.load(io.BytesIO(saved)), flushes
        return SGLangEngineSignatures(ours), end
    yield start
    for process in processes:
        process.kill()
    if started:
        dist.destroy_process_group()


def test_each_bucket_reaches_the_engine_bit_for_bit_over_sglangs_group(engine):
    """One engine process for all (its start is most of the time): two syncs, then a bucket the engine refuses."""
    client, end = engine(refuse="model.layers.9.mlp.weight")
    receiver = SGLangDistributedReceiver(client, master_address="127.0.0.1", master_port=free_port(),
                                         backend="gloo", timeout_s=20)
    bs = buckets()
    sent = [(k, v.clone()) for b in bs for k, v in b.tensors]
    export(receiver, bs)
    export(receiver, buckets())  # a second sync reuses the group: no second init
    refused = Bucket(2, 0, [("model.layers.9.mlp.weight", torch.ones(3)), ("model.norm.weight", torch.ones(4))], 28)
    with pytest.raises(RuntimeError,
                       match=r"refused bucket 2 \(first tensor model.layers.9.mlp.weight\): Failed to update"):
        receiver(refused)
    received, flushes = end()
    sync = ["update_weights_from_distributed"] * 2 + ["flush_cache"]
    assert client.calls == ["init_weights_update_group"] + sync + sync + ["update_weights_from_distributed"]
    assert flushes == 2 and len(received) == 2 * len(sent)
    for (name, got), (want_name, want) in zip(received, sent + sent, strict=True):
        assert name == want_name and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # bit for bit


def test_the_receiver_refuses_a_wrong_engine_and_an_early_bucket():
    with pytest.raises(TypeError, match="pip install sglang"):
        SGLangDistributedReceiver(object(), master_address="127.0.0.1", master_port=1)
    receiver = SGLangDistributedReceiver(SGLangEngineSignatures(None), master_address="127.0.0.1", master_port=1)
    with pytest.raises(RuntimeError, match="before prepare"):
        receiver(buckets()[0])


def test_the_http_client_speaks_the_servers_endpoints():
    """SGLangHTTPEngine against a stand-in of sglang 0.5.23's http_server answers (JSON success/message, 400 when
    refused; /flush_cache in text)."""
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            seen.append((self.path, body, self.headers.get("Authorization")))
            if self.path == "/flush_cache":
                status, text = 200, "Cache flushed.\n"
            else:
                ok = self.path != "/update_weights_from_distributed" or body["names"] != ["bad"]
                status, text = (200 if ok else 400), json.dumps({"success": ok, "message": "m" if ok else "no bad"})
            self.send_response(status)
            self.end_headers()
            self.wfile.write(text.encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = SGLangHTTPEngine(f"http://127.0.0.1:{server.server_port}/", api_key="k")
        assert client.init_weights_update_group(master_address="h", master_port=1, rank_offset=1, world_size=2,
                                                group_name="g", backend="nccl") == (True, "m")
        assert client.update_weights_from_distributed(names=["bad"], dtypes=["float32"], shapes=[[2]],
                                                      group_name="g", flush_cache=False) == (False, "no bad")
        assert client.flush_cache() == (True, "Cache flushed.")
    finally:
        server.shutdown()
    assert [p for p, _, _ in seen] == ["/init_weights_update_group", "/update_weights_from_distributed",
                                       "/flush_cache"]
    assert seen[0][1] == dict(master_address="h", master_port=1, rank_offset=1, world_size=2, group_name="g",
                              backend="nccl") and seen[1][1]["flush_cache"] is False and seen[0][2] == "Bearer k"


def test_the_http_client_takes_the_engines_keywords():
    """The receiver calls by keyword: the server client accepts each keyword sglang.Engine's methods take that the
    receiver passes."""
    import inspect

    for method in ("init_weights_update_group", "update_weights_from_distributed", "flush_cache"):
        engine = set(inspect.signature(getattr(SGLangEngineSignatures, method)).parameters) - {"self", "load_format"}
        assert set(inspect.signature(getattr(SGLangHTTPEngine, method)).parameters) - {"self"} == engine, method
