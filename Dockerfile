# Cluster image: NGC PyTorch (torch, Transformer Engine, apex, NCCL) + megatron-core as pinned in
# requirements.lock + this project.
#   docker build -t moe-pretrain:latest .
# Base: nvcr.io/nvidia/pytorch:25.12-py3 = Python 3.12, PyTorch 2.10.0a0, CUDA 13.1. The tag is
# pinned in pins.toml (ngc_pytorch_tag); tests/test_recipes.py checks the two agree.
ARG NGC_PYTORCH_TAG=25.12-py3
FROM nvcr.io/nvidia/pytorch:${NGC_PYTORCH_TAG}

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1
WORKDIR /workspace/moe

# Fail early if the base image cannot run megatron-core 0.19.2: it needs Python 3.12, and
# Megatron-FSDP with gradient-accumulation fusion needs Transformer Engine >= 2.10.
# (Versions are read from package metadata: importing TE needs a GPU driver.)
RUN python -c "import sys; from importlib.metadata import version; from packaging.version import Version as V; te = version('transformer_engine'); print('python', sys.version.split()[0], 'torch', version('torch'), 'transformer_engine', te); assert sys.version_info[:2] == (3, 12), 'megatron-core 0.19.2 needs Python 3.12'; assert V(te) >= V('2.10'), 'Megatron-FSDP needs transformer_engine >= 2.10'"

# megatron-core exactly as requirements.lock pins it. --no-deps: torch, numpy and packaging come
# with the NGC image and must not be replaced; einops, wandb and emerging-optimizers
# (megatron's --optimizer muon) at the lock's versions.
COPY requirements.lock ./
RUN pip install --no-deps "$(grep '^megatron-core==' requirements.lock)" \
 && pip install $(grep -E '^(einops|wandb|emerging-optimizers)==' requirements.lock) \
 && python -c "from importlib.metadata import version; print('megatron-core', version('megatron-core'))"

# megatron's HuggingFaceTokenizer (--tokenizer-type HuggingFaceTokenizer) and
# `python -m moe_launcher.prepare_data`: transformers, tokenizers, pyarrow, tqdm, tiktoken (what
# tokenizers published as tiktoken code of their own import: Moonlight's, Kimi's) and what they
# need, each at the lock's version; --no-deps so that numpy and torch stay the image's. What
# they need and the image provides (numpy, packaging, PyYAML, filelock, fsspec, Pygments,
# requests) is checked: a missing or too old one fails the build, named.
COPY scripts/check_requirements.py scripts/
RUN pip install --no-deps $(grep -E '^(transformers|tokenizers|tiktoken|huggingface_hub|hf-xet|safetensors|regex|tqdm|pyarrow|typer|rich|shellingham|annotated-doc|markdown-it-py|mdurl|httpx2|httpcore2|truststore|h11|anyio|idna|click|typing_extensions|pydantic|pydantic_core|annotated-types|typing-inspection)==' requirements.lock) \
 && python scripts/check_requirements.py transformers tokenizers pyarrow tqdm tiktoken \
 && python -c "import pyarrow, tiktoken, tokenizers, tqdm, transformers; print('transformers', transformers.__version__, 'tokenizers', tokenizers.__version__)"

# The project itself (pretrain_moe.py, megatron_patches, examples), installed editable so a
# checkout mounted over /workspace/moe is what runs.
COPY . .
RUN pip install --no-deps -e .
