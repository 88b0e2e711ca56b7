# Sourced by the GPU drivers (gpu_checks.sh, convergence/train.sh) from the repository root: NVLink
# multicast off, unbuffered Python, this checkout first on PYTHONPATH, and the megatron-core wheel(s)
# in ${MEGATRON_WHEEL_DIR:-.whl} installed to /tmp/site when megatron.core is not importable.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ! python3 -c "import megatron.core" 2>/dev/null; then
    pip install -q --no-index --no-deps --target /tmp/site "${MEGATRON_WHEEL_DIR:-.whl}"/*.whl
    export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
