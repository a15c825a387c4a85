from setuptools import find_packages, setup


def _version() -> str:
    ns: dict = {}
    exec(open("erniekit/__init__.py").read(), ns)
    return ns["__version__"]


setup(
    name="erniekit",
    version=_version(),
    description="PaddlePaddle-native toolkit for ERNIE 4.5: pretrain, SFT, chat, HF-layout checkpoints",
    # the bundled tokenizer is data in a directory without __init__.py: listed so wheels carry it
    packages=find_packages(include=["erniekit", "erniekit.*"]) + ["erniekit.resources", "erniekit.resources.tokenizer"],
    package_data={"erniekit.resources.tokenizer": ["*"], "erniekit.nn": ["kernels/*.c", "kernels/*.h"]},
    include_package_data=True,
    python_requires=">=3.10",
    install_requires=[line.strip() for line in open("requirements.txt") if line.strip() and not line.startswith("#")],
    extras_require={
        "onnx": ["paddle2onnx>=2.0", "onnxruntime>=1.17"],
        "webui": ["gradio>=6.0,<7"],
        "video": ["av>=12"],  # ERNIE-4.5-VL video files (erniekit/models/ernie4_5_vl/video.py)
        "gguf": ["gguf>=0.17"],  # erniekit export --format gguf (llama.cpp / Ollama)
        "eval": ["lm-eval[api]>=0.4.9"],  # erniekit eval --lm-eval
        # llama.cpp's Python binding compiles llama.cpp (a C++ compiler and cmake, ~4 min on 2 cores):
        # not in `test`; .ci/run installs it for the GGUF test
        "llama-cpp": ["llama-cpp-python==0.3.36"],
        "test": [
            "pytest>=8",
            "pytest-xdist>=3.2",
            "torch==2.13.0",
            "transformers>=5.3",
            "openai>=1.40",
            "paddle2onnx>=2.0",
            "onnxruntime>=1.17",
            "gradio>=6.0,<7",
            "playwright>=1.45",
            "av>=12",
            "peft==0.21.2",
            "gguf>=0.17",
            "lm-eval[api]>=0.4.9",
        ],
    },
    entry_points={"console_scripts": ["erniekit=erniekit.cli:main"]},
)
