from setuptools import find_packages, setup

setup(
    name="twinkle_strategy",
    version="0.1.0",
    description="FSDP2 + expert parallelism for Mixture-of-Experts training, with node-local memory-efficient init",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["twinkle_strategy", "twinkle_strategy.*"]),
    # Public config.json values of the models docs/planning.md plans (twinkle-sft plan needs nothing else).
    package_data={"twinkle_strategy.planning": ["configs/*/config.json"]},
    python_requires=">=3.10",
    # Tested ranges (README "Tested versions"): the lower bounds are what .ci/run's oldest smoke run installs
    # (constraints-oldest.txt), the upper bounds the next minor after the newest release the suite passed on
    # (constraints.txt); the package reads transformers internals that change in minor releases. torch has no
    # upper bound: no known break, and a cap would make a CUDA user swap torch.
    install_requires=[
        "torch>=2.13",
        "transformers>=5.19,<5.25",
        "peft>=0.20,<0.22",
        "modelscope",
        "omegaconf",
        "safetensors",
        "tqdm",
        "matplotlib",
    ],
    entry_points={"console_scripts": ["twinkle-sft=twinkle_strategy.train.cli:main"]},
    extras_require={
        # trl: tests/multiproc/test_trl.py (TRL's SFTTrainer through integrations.transformers); 1.16 runs on transformers 5.19-5.24
        "test": ["pytest", "ruff", "trl>=1.16,<2", "mkdocs>=1.6,<2"],
        # ms-swift's `swift sft --external_plugins` integration (docs/swift.md); tested with ms-swift 4.6.0, which
        # needs transformers<5.20 and peft<0.21: the oldest versions above (constraints-swift.txt)
        "swift": ["ms-swift>=4.6,<5", "transformers>=5.19,<5.20", "peft>=0.20,<0.21", "qwen-vl-utils>=0.0.14"],
    },
)
