"""The engine adapters' own logic, in one process without the engines (their runs against vLLM's and TRL's real
trainer-side code: tests/vllm_engine/test_vllm_engine_adapters.py).

SGLang runs on GPUs only and is not installed here: :class:`SGLangReceiver` is checked against an engine with the
signatures of sglang 0.5.23's ``Engine.update_weights_from_tensor`` / ``flush_cache`` (copied from its source) and
its result conventions (``(success, message)``; an object with ``success``)."""

import importlib.util

import pytest
import torch

from twinkle_strategy.rl.engines.sglang import SGLangReceiver
from twinkle_strategy.rl.engines.trl_client import VLLMClientReceiver
from twinkle_strategy.rl.engines.vllm_server import export_weight_source
from twinkle_strategy.rl.weight_export import Bucket, TensorMeta


class SGLangEngineSignatures:
    """sglang.srt.entrypoints.engine.Engine's two methods, as 0.5.23 declares them; records each call."""

    def __init__(self, refuse_bucket: int | None = None):
        self.calls, self.refuse_bucket = [], refuse_bucket

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update_weights_from_tensor", [(k, v.clone()) for k, v in named_tensors], load_format,
                           flush_cache))
        refused = self.refuse_bucket is not None and len(self.calls) - 1 == self.refuse_bucket
        return (not refused, "shape mismatch for model.norm.weight" if refused else "Success")

    def flush_cache(self):
        self.calls.append(("flush_cache",))
        return type("FlushCacheReqOutput", (), {"success": True})()


def buckets():
    torch.manual_seed(0)
    tensors = [("model.embed_tokens.weight", torch.randn(8, 4)), ("model.norm.weight", torch.randn(4)),
               ("lm_head.weight", torch.randn(8, 4, dtype=torch.bfloat16))]
    return [Bucket(0, 0, tensors[:2], 144), Bucket(1, 0, tensors[2:], 64)]


def manifest(bs):
    return [TensorMeta(k, tuple(v.shape), v.dtype) for b in bs for k, v in b.tensors]


def test_sglang_gets_a_call_per_bucket_and_one_flush():
    engine, bs = SGLangEngineSignatures(), buckets()
    receiver = SGLangReceiver(engine, load_format="direct")
    receiver.prepare(manifest(bs))
    for bucket in bs:
        receiver(bucket)
    receiver.finish()
    assert [c[0] for c in engine.calls] == ["update_weights_from_tensor"] * 2 + ["flush_cache"]
    for call, bucket in zip(engine.calls, bs, strict=False):
        _, named, load_format, flush = call
        assert [k for k, _ in named] == [k for k, _ in bucket.tensors] and load_format == "direct" and flush is False
        assert all(torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(named, bucket.tensors,
                                                                                       strict=True))
    assert receiver.buckets == 2


def test_sglang_refusal_raises_naming_the_bucket_and_engine_message():
    receiver, bs = SGLangReceiver(SGLangEngineSignatures(refuse_bucket=1)), buckets()
    receiver.prepare(manifest(bs))
    receiver(bs[0])
    with pytest.raises(RuntimeError, match=r"refused bucket 1: shape mismatch for model.norm.weight"):
        receiver(bs[1])


@pytest.mark.parametrize("adapter, engine, package", [(SGLangReceiver, object(), "pip install sglang"),
                                                      (VLLMClientReceiver, object(), "pip install 'trl>=1.16'")])
def test_a_wrong_engine_object_is_refused_in_one_line(adapter, engine, package):
    with pytest.raises(TypeError) as raised:
        adapter(engine)
    assert package in str(raised.value) and "\n" not in str(raised.value)


def test_empty_export_and_out_of_order_calls_are_refused():
    receiver = SGLangReceiver(SGLangEngineSignatures())
    with pytest.raises(ValueError, match="no tensor"):
        receiver.prepare([])

    class Client:
        def weight_update(self):
            raise AssertionError("not reached")

        def update_named_params(self, metadata, named_params):
            raise AssertionError("not reached")

    client_receiver = VLLMClientReceiver(Client())
    with pytest.raises(RuntimeError, match="before prepare"):
        client_receiver(buckets()[0])
    with pytest.raises(RuntimeError, match="without prepare"):
        client_receiver.finish()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed in this env")
def test_vllm_server_source_without_vllm_names_the_package():
    with pytest.raises(ImportError) as raised:
        export_weight_source(None, None)
    assert "pip install vllm" in str(raised.value) and "\n" not in str(raised.value)
