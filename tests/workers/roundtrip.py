"""Save and resume right after init, on every rank: a checkpoint the hub's way, read back into zeroed shards.

Shared by the family matrix (fp32, 2 ranks per node) and the bf16 launch (4 ranks per node): each records
what it saved, read and received, so the tests can check that only a tensor's owner ever holds it whole.
"""

import collections
import contextlib
import math
import os
import time

import torch
import torch.distributed as dist
from mem_init import exact_mismatches
from transformers import AutoConfig

from twinkle_strategy import NativeFSDPStrategy
from twinkle_strategy.loading import model_class_for


def roundtrip_case(path: str, family: str, lora: bool, rank: int, *, with_adapter, dtype=torch.float32,
                   ep_size: int = 2, max_file_bytes: int = 2**20) -> dict:
    """Init, then save (a Hugging Face checkpoint, or an adapter run's trainable files) and read it back into
    zeroed shards: the files must load with plain from_pretrained, the shards come back bit for bit, and a
    tensor that cannot be written or read as rows is held whole by one owner rank only.

    ``with_adapter(model, lora, family)`` adds the same fresh LoRA on every rank and in the reference; in bf16,
    full parameters train with ``mixed_precision='bf16'`` as users run them."""
    from twinkle_strategy.checkpoint.reading import IOStats, read_model_files, read_trainable_files
    from twinkle_strategy.checkpoint.writing import TrainableFiles, save_model_config, save_model_files
    from twinkle_strategy.distributed.dtensor import local_tensor
    from twinkle_strategy.distributed.fail_together import step_reporter
    from twinkle_strategy.shards.plan import regions_of
    from twinkle_strategy.shards.whole_tensors import owner_of

    reference = with_adapter(model_class_for(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype=dtype),
                             lora, family)
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    del reference
    # Small buckets: a tensor read whole must still be read once per node, not once per chunk or receiver.
    precision = "bf16" if dtype == torch.bfloat16 and not lora else "no"
    strategy = NativeFSDPStrategy(ep_size=ep_size, mixed_precision=precision, memory_efficient_init=True,
                                  timeout_s=120, init_bucket_mb=1 / 1024)
    with counting_whole_reads() as whole_reads:
        model, _ = strategy.wrap_model(with_adapter(strategy.from_pretrained(path, dtype=dtype), lora, family))
    init_whole = strategy.init_report.whole_tensors
    out = os.path.join(os.environ["TWINKLE_TEST_OUT"], f"roundtrip-{family}{'-lora' if lora else ''}-{dtype}")
    if rank == 0:
        os.makedirs(out)
    dist.barrier()
    saved, read = IOStats(), IOStats()
    names = {n for n, p in model.named_parameters() if p.requires_grad} if lora else None
    regions = regions_of(model, strategy.ep_plan, names=names)
    if lora:
        files = TrainableFiles(model, strategy.ep_plan, max_file_bytes=max_file_bytes)
        if rank == 0:
            files.create(out)
        dist.barrier()
        assert files.write(out, chunk_bytes=4096, stats=saved) is None
    else:
        save_model_files(out, model, ep_plan=strategy.ep_plan, stats=saved, max_file_bytes=max_file_bytes, chunk_bytes=4096,
                         step_done=step_reporter("roundtrip save"))
        if rank == 0:
            save_model_config(out, model)
    dist.barrier()
    loaded_mismatches = []
    if rank == 0 and not lora:  # plain transformers reads what every rank wrote
        loaded = model_class_for(AutoConfig.from_pretrained(out)).from_pretrained(out, dtype=dtype)
        loaded_mismatches = exact_mismatches(loaded.state_dict(), state)
    with torch.no_grad():
        for region in regions:
            region.local.zero_()
    (read_trainable_files if lora else read_model_files)(out, model, strategy.ep_plan, read)
    resumed = strategy.full_state_dict(model)
    resumed_mismatches = exact_mismatches({k: resumed[k] for k in (names or resumed)},
                                          {k: state[k] for k in (names or state)})
    world = dist.get_world_size()
    owner_failure = failing_owner_read(out, model, strategy, rank) if family == "bailing_hybrid" else None
    adapter, adapter_received, adapter_mismatches = {}, {}, []
    if lora:  # the adapter as the trainer saves it
        adapter, adapter_received = received_bytes(
            lambda: strategy.full_state_dict(model, rank0_only=True, keys=names))
        if rank == 0:
            adapter_mismatches = exact_mismatches(adapter, {k: state[k] for k in names})
    mine = sum(local_tensor(r.local).numel() * r.local.element_size() for r in regions)
    return dict(
        family=family, lora=lora, init_whole=init_whole, whole_reads=dict(whole_reads), owner_failure=owner_failure,
        loaded_mismatches=loaded_mismatches,
        resumed_mismatches=resumed_mismatches, adapter_keys=len(adapter), adapter_keys_total=len(names or ()), adapter_mismatches=adapter_mismatches,
        adapter_received=adapter_received, gathered=saved.gathered, bytes_received=saved.bytes_received,
        bytes_read=read.bytes_read, local_bytes=mine,
        # Tensors this rank owns (it alone holds them whole when they must be), and their full bytes.
        owned={r.name: math.prod(r.full_shape) * r.need.dtype.itemsize for r in regions
               if owner_of(r.name, world) == rank},
        runs={r.name: len(r.runs) for r in regions if r.runs is not None and len(r.runs) > 1},
    )


FAILING_WHOLE_READ = "model.layers.0.self_attn.conv1d.weight"


def failing_owner_read(directory: str, model, strategy, rank: int) -> dict:
    """Resume again, the owner of a tensor served whole failing to read it: every rank must raise, naming it."""
    from twinkle_strategy.checkpoint.layout import CheckpointLayout
    from twinkle_strategy.checkpoint.reading import IOStats, read_model_files
    from twinkle_strategy.shards.whole_tensors import owner_of

    owner = owner_of(FAILING_WHOLE_READ, dist.get_world_size())
    real = CheckpointLayout.read_rows

    def read_rows(self, name, rows=None):
        if rank == owner and name == FAILING_WHOLE_READ and rows is None:
            raise OSError(f"injected read failure of {name}")
        return real(self, name, rows)

    CheckpointLayout.read_rows = read_rows
    start = time.perf_counter()
    try:
        read_model_files(directory, model, strategy.ep_plan, IOStats())
        error = None
    except Exception as exc:  # noqa: BLE001 - the test checks type and message
        error = f"{type(exc).__name__}: {exc}"
    finally:
        CheckpointLayout.read_rows = real
    return dict(owner=owner, error=error, seconds=time.perf_counter() - start)


@contextlib.contextmanager
def counting_whole_reads():
    """How many times each model tensor was read whole from the checkpoint (buffers, rules needing it whole)."""
    from twinkle_strategy.checkpoint.layout import CheckpointLayout

    counts = collections.Counter()
    real = CheckpointLayout.read_rows

    def read_rows(self, name, rows=None):
        if rows is None:
            counts[name] += 1
        return real(self, name, rows)

    CheckpointLayout.read_rows = read_rows
    try:
        yield counts
    finally:
        CheckpointLayout.read_rows = real


def received_bytes(call):
    """``call()``'s result, and the tensor bytes this rank received in it: (point-to-point, all_gather)."""
    counts = {"p2p": 0, "all_gather": 0}
    real_batch, real_all_gather = dist.batch_isend_irecv, dist.all_gather

    def batch(ops):
        counts["p2p"] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.irecv)
        return real_batch(ops)

    def all_gather(parts, tensor, *args, **kwargs):
        counts["all_gather"] += sum(p.numel() * p.element_size() for p in parts) - tensor.numel() * tensor.element_size()
        return real_all_gather(parts, tensor, *args, **kwargs)

    dist.batch_isend_irecv, dist.all_gather = batch, all_gather
    try:
        return call(), counts
    finally:
        dist.batch_isend_irecv, dist.all_gather = real_batch, real_all_gather
