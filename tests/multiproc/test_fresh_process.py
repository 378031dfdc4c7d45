"""What only a fresh Python process shows (its own imports), checked in one such process for the whole module: the
package root loads the strategy on first use, and the memory plan of a 671B model on 64 ranks reads config.json alone
in CPU seconds. A process that imports torch and transformers (~7-17 s on 2 cores), so not in the one-process tier;
the cheap half of the import check (one module loads nothing else) stays in tests/unit/test_structure.py."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from multinode import REPO

CONFIGS = REPO / "twinkle_strategy" / "planning" / "configs"


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    model = tmp_path_factory.mktemp("plan") / "deepseek-v3"
    model.mkdir()
    (model / "config.json").write_text((CONFIGS / "deepseek-v3" / "config.json").read_text())
    script = textwrap.dedent(f"""
        import json, sys, time
        opened = []
        sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" and
                         str(args[0]).startswith({str(model)!r}) else None)
        import twinkle_strategy
        strategy_module = twinkle_strategy.NativeFSDPStrategy.__module__
        fsdp_loaded = 'torch.distributed.fsdp' in sys.modules
        from twinkle_strategy.config import StrategyConfig
        from twinkle_strategy.planning import PlanRequest, plan_memory
        start, cpu = time.perf_counter(), time.process_time()
        plan = plan_memory(PlanRequest({str(model)!r}, strategy=StrategyConfig(ep_size=64, memory_efficient_init=True),
                                       nnodes=8, nproc_per_node=8, max_length=2048))
        print(json.dumps({{"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu,
                          "opened": sorted(set(opened)),
                          "peak": plan.peak, "params": plan.step.params,
                          "strategy_module": strategy_module, "fsdp_loaded": fsdp_loaded}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return model, json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_package_root_loads_the_strategy_on_first_use(fresh):
    _, result = fresh
    assert result["strategy_module"] == "twinkle_strategy.strategy", result
    assert result["fsdp_loaded"] is True, result


def test_deepseek_v3_on_64_ranks_plans_from_config_json_alone(fresh):
    """With an audit hook that records every file the process opens under the model's directory: only config.json
    may be read. The plan itself is timed."""
    model, result = fresh
    assert result["opened"] == [str(model / "config.json")], result["opened"]
    # 671B parameters in bf16 over 64 ranks: about 21 GB of shards each (experts over ep 64, the rest over 64).
    assert 18e9 < result["params"] < 23e9, result
    # CPU seconds of this one process: the shared test machine's load does not count against the plan.
    assert result["cpu_seconds"] < 60, result
