# The afd image that deploy/k8s/ runs (registry.example.com/afd:0.1.0 there): afd and its commands
# (afd, afd-attention, afd-ffn) on a CPU torch. The manifests set `command:`, so the image has no
# ENTRYPOINT; CMD only prints the help.
#
#   docker build -t registry.example.com/afd:0.1.0 .
#
# Device images take the same file with build args (deploy/k8s/README.md, "Image"):
#   CUDA:   --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128   (CUDA wheels carry their runtime)
#   Ascend: --build-arg BASE_IMAGE=<a CANN image with Python >= 3.10> --build-arg EXTRA_PIP=torch_npu==<torch's>
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# = the torch of requirements.txt, the lock the test suite runs on (its CPU build). pyproject.toml only says torch>=2.4.
ARG TORCH_SPEC=torch==2.13.0
# The CPU build: PyPI's default Linux x86-64 torch is the CUDA one, gigabytes of libraries a CPU pod never loads.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Extra packages installed against that torch, e.g. torch_npu for Ascend (it must match torch's version).
ARG EXTRA_PIP=
# Not root by default; an accelerator whose device files need root or a group can pass AFD_UID=0.
ARG AFD_UID=1000

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, in its own layer: the large part, rebuilt only when the pin changes. `pip install .` then
# finds torch>=2.4 satisfied and leaves it alone instead of pulling PyPI's CUDA build. TORCH_INDEX only,
# not PyPI as an extra index (the torch index carries torch's dependencies): with both, pip may take
# either build. EXTRA_PIP is the builder's own spec, pinned there (hence the DL3013 exception).
# hadolint ignore=DL3013
RUN pip install --index-url "${TORCH_INDEX}" "${TORCH_SPEC}" \
    && if [ -n "${EXTRA_PIP}" ]; then pip install ${EXTRA_PIP}; fi

WORKDIR /opt/afd
COPY pyproject.toml README.md ./
COPY afd ./afd
COPY attention_node ./attention_node
COPY ffn_node ./ffn_node
RUN pip install . && rm -rf /opt/afd/build

# A writable HOME: `model.path: demo` makes the demo checkpoint into ~/.cache/afd on first start.
RUN if [ "${AFD_UID}" = 0 ]; then mkdir -p /home/afd; \
    else useradd --uid "${AFD_UID}" --create-home --home-dir /home/afd afd; fi
ENV HOME=/home/afd
USER ${AFD_UID}
WORKDIR /home/afd

CMD ["afd", "--help"]
