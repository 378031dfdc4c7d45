"""What a newcomer reads in the first hour agrees with what runs (issue 31 point 5): ``--help`` after a recipe,
``--version``, the versions the docs and scripts name, the expert-load heatmap's labels."""

import re
import subprocess
import sys
from importlib import metadata

from multinode import REPO

DEMO = str(REPO / "yaml" / "demo.yaml")
DATASET = str(REPO / "examples" / "data" / "demo_sft.jsonl")


def pins(constraints: str) -> dict[str, str]:
    lines = (REPO / constraints).read_text().splitlines()
    return dict(line.split("==", 1) for line in lines if "==" in line and not line.startswith("#"))


def test_help_after_a_recipe_shows_its_values_and_every_flag_a_real_help_line(capsys):
    from twinkle_strategy.train.cli import SWIFT_FLAGS, build_parser, main

    try:
        main([DEMO, "train.max_steps=7", "--help", "--learning-rate", "0.002"])
    except SystemExit as exc:
        assert exc.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    # The recipe's values, with this command's settings: not the built-in defaults (max_steps -1, lr 0.0001).
    assert "--max_steps V optimizer steps to train; > 0 overrides num_train_epochs (demo.yaml: 7) " \
           "[train.max_steps]" in text, text
    assert "(demo.yaml: 0.002) [train.learning_rate]" in text and "(demo.yaml: 2) [strategy.ep_size]" in text
    assert "(demo.yaml: [q_proj, k_proj, v_proj, o_proj]) [tuner.target_modules]" in text
    # Without a recipe: the defaults, named as such.
    assert "(default: -1) [train.max_steps]" in " ".join(build_parser().format_help().split())
    for flag, (key, help_line) in SWIFT_FLAGS.items():
        assert len(help_line) > 8 and "training argument" not in help_line, (flag, help_line)
        assert f"[{key}]" in text, flag


def test_version_names_the_installed_and_the_tested_versions():
    """``twinkle-sft --version``: the installed torch/transformers/peft and setup.py's tested ranges, which the
    README's table repeats."""
    cli = REPO / ".venv" / "bin" / "twinkle-sft"
    command = [str(cli)] if cli.exists() else [sys.executable, "-m", "twinkle_strategy.train.cli"]
    proc = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc
    lines = proc.stdout.splitlines()
    assert lines[0] == "twinkle-sft 0.1.0"
    setup = (REPO / "setup.py").read_text()
    readme = (REPO / "README.md").read_text()
    for line, name in zip(lines[1:], ("torch", "transformers", "peft"), strict=True):
        assert line.startswith(f"  {name} {metadata.version(name)} (tested {name}"), line
        assert "OUTSIDE" not in line, line  # the suite runs on the pinned set, inside the ranges
        declared = re.search(rf'"{name}(>=[^"]+)"', setup).group(1)
        assert sorted(declared.split(",")) == sorted(line.split(f"tested {name}")[1].rstrip(")").split(",")), line
        # The README's table: the declared range and the pinned version of the suite.
        row = next(r for r in readme.splitlines() if r.startswith(f"| {name} |"))
        assert f"`{declared}" in row and pins("constraints.txt")[name].split("+")[0] in row, row


def test_docs_and_scripts_name_the_torch_their_environment_has():
    """Every 'torch X.Y.Z' in the docs and scripts is a pinned one, and the swift scripts name the swift env's
    (examples/swift_sft.sh once named .venv's 2.13.0 for an environment that has 2.14.1)."""
    venv_torch = pins("constraints.txt")["torch"].split("+")[0]
    swift_torch = pins("constraints-swift.txt")["torch"].split("+")[0]
    assert venv_torch != swift_torch  # else this test could not tell them apart
    swift_scripts = [*(REPO / "examples").glob("swift_*.sh"), REPO / "scripts" / "swift_env.sh"]
    named = []
    for path in [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "examples").glob("*.sh"),
                 *(REPO / "scripts").glob("*.sh")]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for version in re.findall(r"torch (\d+\.\d+\.\d+)", line):
                where = (path.relative_to(REPO), number, line)
                assert version in (venv_torch, swift_torch), where
                if path in swift_scripts and ".venv" not in line:  # the swift env, not .venv
                    assert version == swift_torch, where
                named.append(path.name)
    assert "swift_sft.sh" in named and "README.md" in named, named


def test_byte_figures_of_the_init_bar_and_logs_agree():
    """The init bar once said "read 0 MiB from disk" where the log said 0.3 MiB, and the save log "wrote 0.5 MiB
    of its 0.3 MiB shard" (what it wrote is not part of that shard)."""
    from twinkle_strategy.checkpoint.training import SaveReport
    from twinkle_strategy.init.engine import InitReport, progress_postfix

    read = int(0.3 * 2**20)
    report = InitReport(rank=0, is_source=True, seconds=1.0, bytes_sent=0, bytes_received=0, shard_bytes=read,
                        buffer_bytes=0, buckets=1, collective_calls=1, peak_rss_bytes=0, tensors=1, bytes_read=read)
    assert progress_postfix(read) == "read 0.3 MiB from the checkpoint"
    assert "read 0.3 MiB from the checkpoint in 0.00s" in report.log_line()
    save = SaveReport(path="ck", rank=0, seconds=1.0, bytes_written=int(0.5 * 2**20), bytes_received=0,
                      shard_bytes=read, rss_before_bytes=0, peak_rss_bytes=0).log_line()
    assert "wrote 0.5 MiB (weights, and optimizer state when saved; it keeps a 0.3 MiB model shard)" in save, save
