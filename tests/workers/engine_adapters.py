"""The server-side engine adapters against vLLM's and TRL's own trainer-side code, on CPU, in one process.

Run with the vllm env's python (tests/vllm_engine/test_vllm_engine_adapters.py): the strategy at world size 1 wraps a
tiny Qwen3-MoE and trains it one step; then

* ``export_weight_source``: vLLM's ``NCCLTrainerWeightTransferEngine`` as the sender (trainer rank 0) drives its
  HTTP client (vLLM's ``HTTPVLLMWeightSyncClient``) against a local server that records each request, and streams
  the source through vLLM's own metadata check (``_checked_iter``) into its packed NCCL producer, which is the one
  part recorded instead (a NCCL communicator cannot exist on CPU). Twice: the source is re-iterable.
* the same source against vLLM's ``ModuleSource`` of a plain transformers model holding the trainer's weights.
* TRL's ``VLLMClient`` (real: its health check, model query, weight update and prefix-cache reset over HTTP to
  that server) fed by ``VLLMClientReceiver``; its NCCL broadcast recorded likewise. Then the same through
  ``sync_server_engine``, what ``with_strategy(GRPOTrainer)`` runs in ``vllm_mode="server"``.

Every recorded request and tensor is compared with a reference export of the same model, bucket by bucket.
"""

import argparse
import json
import os
import sys
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29613")
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from twinkle_strategy import NativeFSDPStrategy  # noqa: E402
from twinkle_strategy.integrations.transformers.grpo_vllm import sync_server_engine  # noqa: E402
from twinkle_strategy.rl.engines.trl_client import VLLMClientReceiver  # noqa: E402
from twinkle_strategy.rl.engines.vllm_server import export_weight_source  # noqa: E402

BUCKET = 64 * 1024


class Recorder(BaseHTTPRequestHandler):
    """A stand-in for the server's HTTP surface: answers what the clients ask and records every POST."""

    posts: list = []

    def _reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 - http.server's name
        self._reply({"data": [{"id": "tiny"}]} if self.path.startswith("/v1/models") else {})

    def do_POST(self):  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"null")
        Recorder.posts.append((self.path.lstrip("/"), body))
        self._reply({})

    def log_message(self, *args):
        pass


def broadcast_recorder(sink: list):
    """What replaces vLLM's ``packed_nccl_broadcast_producer`` (same arguments): takes the stream as NCCL would."""
    def produce(iterator, group, src, post_iter_func, **_):
        assert src == 0
        for item in iterator:
            sink.append((item[0], post_iter_func(item).clone()))
    return produce


def reference(strategy, model) -> list[list[tuple[str, torch.Tensor]]]:
    return [[(k, v.clone()) for k, v in bucket.tensors] for bucket in strategy.export_weights(model, bucket_bytes=BUCKET)]


def same(pairs, expected) -> bool:
    return ([k for k, _ in pairs] == [k for k, _ in expected]
            and all(a.dtype == b.dtype and torch.equal(a, b) for (_, a), (_, b) in zip(pairs, expected, strict=True)))


def vllm_sender(strategy, model, buckets, server_url) -> dict:
    import vllm.distributed.weight_transfer.nccl_engine as nccl_engine
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ParamMeta, WeightSource

    flat = [pair for bucket in buckets for pair in bucket]
    source = export_weight_source(strategy, model, bucket_bytes=BUCKET)
    out = {"is_weight_source": isinstance(source, WeightSource)}
    out["metadata_equals_export"] = source.metadata() == [ParamMeta(k, v.dtype, tuple(v.shape)) for k, v in flat]
    streamed: list = []
    nccl_engine.packed_nccl_broadcast_producer = broadcast_recorder(streamed)
    engine = nccl_engine.NCCLTrainerWeightTransferEngine(client=HTTPVLLMWeightSyncClient(server_url), source=source,
                                                         is_sender=True)
    engine.model_update_group = object()  # opened by trainer_init over NCCL (a GPU); the producer above takes it
    rounds = []
    for _ in range(2):
        Recorder.posts.clear()
        streamed.clear()
        engine.send_weights()
        paths = [p for p, _ in Recorder.posts]
        info = dict(Recorder.posts[1][1]["update_info"]) if len(paths) > 1 else {}
        rounds.append({
            "requests": paths,
            "update_info_equals_export": info == {"names": [k for k, _ in flat],
                                                  "dtype_names": [str(v.dtype).split(".")[-1] for _, v in flat],
                                                  "shapes": [list(v.shape) for _, v in flat]},
            "stream_equals_export": same(streamed, flat),
            "report_buckets": source.report.buckets,
        })
    out["rounds"], out["export_buckets"], out["tensors"] = rounds, len(buckets), len(flat)
    return out


def against_module_source(strategy, model, ckpt) -> dict:
    """vLLM's ``ModuleSource`` over a plain transformers model given the trainer's weights by the export
    (``ModelReceiver``) against a pass of ``export_weight_source``: its parameters (transformers' fused experts)
    rebuilt from the source's per-expert keys."""
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer import ModuleSource

    from twinkle_strategy.rl.receivers import ModelReceiver

    plain = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in plain.named_parameters()}
    strategy.export_weights(model, bucket_bytes=BUCKET).send_to(ModelReceiver(plain))
    ours = {name: value.clone() for name, value in export_weight_source(strategy, model, bucket_bytes=BUCKET)}
    module = ModuleSource(plain)
    checked, moved, problems = 0, 0, []
    for meta, (name, value) in zip(module.metadata(), module, strict=True):
        if name in ours:
            expected = ours[name]
        elif name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            n = value.shape[0]
            expected = torch.stack([torch.cat([ours[f"{prefix}{j}.gate_proj.weight"], ours[f"{prefix}{j}.up_proj.weight"]])
                                    for j in range(n)])
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            expected = torch.stack([ours[f"{prefix}{j}.down_proj.weight"] for j in range(value.shape[0])])
        else:
            problems.append(f"{name}: not in the source")
            continue
        if (meta.dtype, meta.shape) != (expected.dtype, tuple(expected.shape)) or not torch.equal(value, expected):
            problems.append(f"{name}: differs")
        checked += 1
        moved += not torch.equal(value, before[name])
    return {"checked": checked, "moved": moved, "problems": problems[:5]}


def trl_client(strategy, model, buckets, server_url) -> dict:
    import trl.generation.vllm_client as trl_vllm_client
    from trl.generation.vllm_client import VLLMClient

    streamed: list = []
    trl_vllm_client.packed_nccl_broadcast_producer = broadcast_recorder(streamed)
    client = VLLMClient(base_url=server_url)  # real: /health, /v1/models
    client.communicator = object()  # init_communicator opens it over NCCL (a GPU); the producer above takes it
    Recorder.posts.clear()
    receiver = VLLMClientReceiver(client)
    report = strategy.export_weights(model, bucket_bytes=BUCKET).send_to(receiver)
    out = {"receiver_buckets": receiver.buckets, "report_buckets": report.buckets}
    out.update(client_round(streamed, buckets))
    # GRPOTrainer(vllm_mode="server") under with_strategy: its sync (TRL's replaced) on the trainer's client
    streamed.clear()
    Recorder.posts.clear()
    trainer = types.SimpleNamespace(model=model, strategy=strategy, weight_sync_reports=[],
                                    accelerator=types.SimpleNamespace(unwrap_model=lambda m: m),
                                    vllm_generation=types.SimpleNamespace(vllm_client=client),
                                    state=types.SimpleNamespace(global_step=1))
    sync_server_engine(trainer, bucket_bytes=BUCKET)
    out["grpo"] = client_round(streamed, buckets)
    return out


def client_round(streamed, buckets) -> dict:
    paths = [p for p, _ in Recorder.posts]
    updates = [body["update_info"] for p, body in Recorder.posts if p == "update_weights"]
    expected = [{"names": [k for k, _ in b], "dtype_names": [str(v.dtype).removeprefix("torch.") for _, v in b],
                 "shapes": [list(v.shape) for _, v in b]} for b in buckets]
    return {"requests": paths, "updates_equal_buckets": [dict(u) for u in updates] == expected,
            "stream_equals_export": same(streamed, [pair for bucket in buckets for pair in bucket])}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    strategy = NativeFSDPStrategy(ep_size=1, mixed_precision="no", memory_efficient_init=True)
    model = strategy.from_pretrained(args.ckpt)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = strategy.wrap_model(model, optimizer)
    ids = torch.arange(2 * 16).reshape(2, 16) % model.config.vocab_size
    model(input_ids=ids, labels=ids).loss.backward()  # one step: the weights are no longer the checkpoint's
    optimizer.step()
    optimizer.zero_grad()
    buckets = reference(strategy, model)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    result = {"vllm_sender": vllm_sender(strategy, model, buckets, url),
              "module_source": against_module_source(strategy, model, args.ckpt),
              "trl_client": trl_client(strategy, model, buckets, url)}
    server.shutdown()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    strategy.shutdown()


if __name__ == "__main__":
    main()
