from setuptools import find_packages, setup

setup(
    name="twinkle_strategy",
    version="0.1.0",
    description="FSDP2 + expert parallelism for Mixture-of-Experts training, with node-local memory-efficient init",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["twinkle_strategy", "twinkle_strategy.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.7",
        "transformers>=5",
        "peft>=0.17",
        "modelscope",
        "omegaconf",
        "safetensors",
        "tqdm",
        "matplotlib",
    ],
    entry_points={"console_scripts": ["twinkle-sft=twinkle_strategy.train.cli:main"]},
    extras_require={
        "test": ["pytest", "ruff"],
        # ms-swift's `swift sft --external_plugins` integration (docs/swift.md); tested with ms-swift 4.6.0
        "swift": ["ms-swift>=4.6,<5", "transformers>=5,<5.20", "peft>=0.17,<0.21", "qwen-vl-utils>=0.0.14"],
    },
)
