"""Weight exports of a ``quantized_base: keep`` LoRA run (strategy.export_weights), for tests/workers/quantized_keep.py.

After the steps, before save_merged consumes the model: the merged weights in bf16, in the release's format, the
adapter alone, and a second bf16 export with ``changed_only``, each sent from the ranks that own the rows to a
plain process outside the group (export_receiver.py's "collect": every tensor by name, as received). Rank 0
then compares them with what save_merged wrote: the bf16 export with ``save_merged(merged_format='bf16')``, the
release-format one with ``save_merged(merged_format='release')``, tensor by tensor, bit for bit.
"""

import os

import torch
from weight_export import Receiver

BUCKET = 1 << 14  # 16 KiB: the tiny releases' experts are cut between buckets

_RECEIVER = []  # rank 0's receiver process, started once for every case of the launch


def receiver():
    if not _RECEIVER:
        _RECEIVER.append(Receiver())
    return _RECEIVER[0]


def run_exports(strategy, model, path: str, root: str) -> dict:
    """Every rank: the four exports; rank 0 sends them to the receiver process, which writes them to ``root``."""
    os.makedirs(root, exist_ok=True)
    out = {}
    for name, options in [("bf16", dict(dtype=torch.bfloat16)),
                          ("release", dict(dtype=torch.bfloat16, merged_format="release", release=path)),
                          ("adapter", dict(lora="adapter")),
                          ("changed", dict(dtype=torch.bfloat16, changed_only=True))]:
        here = receiver() if strategy.rank == 0 else None
        if here is not None:
            here.connection.send(("collect", os.path.join(root, f"export-{name}.pt")))
        export = strategy.export_weights(model, bucket_bytes=BUCKET, **options)
        report = export.send_to(here.sender if here is not None else None)
        out[name] = dict(buckets=report.buckets, bytes_total=report.bytes_total,
                         largest_bucket_bytes=report.largest_bucket_bytes,
                         ranks=[vars(f) for f in report.ranks],
                         modules=list(export.release.modules) if export.release is not None else None)
        if here is not None:
            reply = here.connection.recv()
            assert reply[0] == "ok", reply
            out[name]["received_buckets"] = reply[1]["buckets"]
    return out


def compare(exports: dict, root: str, *, release_dir: str, bf16_dir: str, adapter_dir: str, modules: list[str],
            checkpoint_tensors) -> dict:
    """Rank 0: each export as received against the files save_merged (and save_pretrained, for the adapter) wrote."""
    received = {name: torch.load(os.path.join(root, f"export-{name}.pt")) for name in exports}
    bf16, release = checkpoint_tensors(bf16_dir), checkpoint_tensors(release_dir)
    as_bytes = lambda t: t.contiguous().view(torch.uint8).reshape(-1)  # noqa: E731

    def differences(got: dict, want: dict) -> list[str]:
        """Keys missing or extra, and keys whose dtype, shape or bytes differ (empty: bit for bit)."""
        out = sorted(set(got) ^ set(want))
        return out + [k for k in sorted(set(got) & set(want)) if got[k].dtype != want[k].dtype
                      or got[k].shape != want[k].shape or not torch.equal(as_bytes(got[k]), as_bytes(want[k]))]

    adapter_file = os.path.join(adapter_dir, "adapter_model.safetensors")
    changed = received["changed"]
    return dict(
        figures=exports, modules_equal=exports["release"]["modules"] == modules,
        bf16_differences=differences(received["bf16"], bf16)[:5], bf16_keys=len(received["bf16"]),
        release_differences=differences(received["release"], release)[:5], release_keys=len(received["release"]),
        release_stored_dtypes=sorted({str(v.dtype) for v in received["release"].values()}),
        largest_tensor_bytes=max(v.numel() * v.element_size() for v in [*bf16.values(), *release.values()]),
        # changed_only after the complete bf16 export: the merged weights only, as the bf16 export had them.
        changed_keys=sorted(changed), changed_differences=differences(changed, {k: bf16[k] for k in changed})[:5],
        merged_count=len(merged_keys(release_dir)),
        adapter_keys=sorted(received["adapter"]),
        adapter_differences=(differences(received["adapter"], checkpoint_tensors(adapter_dir))[:5]
                             if os.path.isfile(adapter_file) else None))


def merged_keys(release_dir: str) -> set[str]:
    """The keys of the release-format directory's merged files (the rest are the release's own tensors)."""
    from safetensors import safe_open

    merged = set()
    for file in os.listdir(release_dir):
        if file.startswith("model-merged"):
            with safe_open(os.path.join(release_dir, file), "pt") as reader:
                merged |= set(reader.keys())
    return merged
