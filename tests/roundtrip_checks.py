"""Checks of a save and resume right after init (tests/workers/roundtrip.py), shared by the fp32 family matrix
and the bf16 launch: exact round trip, and no tensor held, received or read whole but by its owner."""


def check_roundtrips(ranks: dict, roundtrips: tuple[str, ...], *, two_runs: bool) -> None:
    """The checks of tests/workers/roundtrip.py's cases (``family[+lora]``); ``two_runs``: the layout gives
    some rank a LongCat region of two runs (its last experts and its zero slots in one FSDP shard)."""
    cases = {rank: {(c["family"], c["lora"]): c for c in data["roundtrips"]} for rank, data in ranks.items()}
    for rank, by_case in cases.items():
        assert [f"{f}{'+lora' if lora else ''}" for f, lora in by_case] == list(roundtrips)
        for (family, lora), c in by_case.items():
            case = f"rank {rank} {family}{' + LoRA' if lora else ''}"
            assert c["loaded_mismatches"] == [], f"{case}: plain from_pretrained of the save differs"
            assert c["resumed_mismatches"] == [], f"{case}: shards read back differ"
            # Init: a tensor read whole (a buffer, a rule that needs it whole) is read once per node, by its source.
            assert set(c["whole_reads"].values()) <= {1}, f"{case}: {c['whole_reads']}"
            assert set(c["init_whole"]) <= set(c["whole_reads"]), case
            if lora:  # the adapter as saved: gathered on rank 0 only, equal to the single process's
                assert c["adapter_mismatches"] == [] and (c["adapter_keys"] > 0) == (rank == 0), case
                # Rank 0 receives the others' regions; the others receive nothing but the small region table.
                assert (c["adapter_received"]["p2p"] > 0) == (rank == 0), (case, c["adapter_received"])
                table = 3 * 8 * c["adapter_keys_total"] * (len(cases) - 1)  # (ep rank, rows) per tensor, int64
                assert 0 < c["adapter_received"]["all_gather"] <= table, case
            # Only a tensor's owner holds it whole, and only tensors that cannot be rows.
            assert set(c["gathered"]) <= set(c["owned"]), case
            assert (c["bytes_received"] > 0) == bool(c["gathered"]), case
            # Resuming reads this rank's rows, plus whole the tensors it owns and serves (no rank reads more).
            assert c["bytes_read"] <= c["local_bytes"] + sum(c["owned"][n] for n in c["gathered"]), case
    for family, lora in [(f.partition("+")[0], bool(f.partition("+")[2])) for f in roundtrips]:
        gathered = [n for by_case in cases.values() for n in by_case[(family, lora)]["gathered"]]
        assert len(gathered) == len(set(gathered)), f"{family}: a tensor was held whole by two ranks: {gathered}"
        two_run_regions = {n for by_case in cases.values() for n, runs in by_case[(family, lora)]["runs"].items()
                           if runs == 2}
        if family == "longcat_flash" and not lora:
            # The zero slots travel as rows, at init and in the checkpoint: nothing read or held whole.
            assert gathered == []
            if two_runs:
                assert two_run_regions == {f"model.layers.{i}.mlp.experts.gate_up_proj" for i in (0, 1)}
            for by_case in cases.values():
                assert by_case[(family, lora)]["init_whole"] == []
                assert by_case[(family, lora)]["bytes_read"] == by_case[(family, lora)]["local_bytes"]
        elif family == "longcat_flash":
            assert gathered and all(".lora_B." in n for n in gathered), gathered
            if two_runs:
                assert two_run_regions and all(".lora_A." in n for n in two_run_regions), two_run_regions
        else:
            # The owner of a tensor served whole fails to read it: every rank raises at once, naming it.
            for by_case in cases.values():
                failure = by_case[(family, lora)]["owner_failure"]
                assert failure["error"].startswith("RanksFailedError"), failure
                assert f"rank {failure['owner']}: OSError: injected read failure" in failure["error"], failure
                assert failure["seconds"] < 30, failure
            conv = {f"model.layers.{i}.self_attn.conv1d.weight" for i in (0, 1)}
            assert set(gathered) == conv
            assert {n for by_case in cases.values() for n in by_case[(family, lora)]["init_whole"]} == conv
