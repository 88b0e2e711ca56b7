#!/usr/bin/env bash
# Build DeepGEMM's Python extension against this machine's torch, for the grouped-GEMM benchmark's
# DeepGEMM peer (benchmarks/deepgemm_peer.py). DeepGEMM is optional and never imported by the package.
#
#   scripts/build_deepgemm.sh SRC DEST
#
# SRC: a DeepGEMM source tree (github.com/deepseek-ai/DeepGEMM or a fork, with its third-party/cutlass
# and third-party/fmt submodules checked out). DEST: a new folder; the build goes there and SRC is left
# as it was. Then: PYTHONPATH=DEST python -m benchmarks.bench_grouped_gemm --deepgemm
#
# Why not `pip install`: the published wheels' compiled library is built against one torch and does not
# load on another; this compiles the same csrc/python_api.cpp with the local torch's headers. Its
# kernels are compiled later, at first use, by DeepGEMM's own JIT (the CUDA toolkit's nvcc).
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: $0 DEEPGEMM_SOURCE_DIR DEST_DIR" >&2; exit 2
fi
SRC=$(cd "$1" && pwd); DEST=$2; PY=${PYTHON:-python3}
for need in csrc/python_api.cpp deep_gemm/__init__.py third-party/cutlass/include/cute third-party/fmt/include; do
  [ -e "$SRC/$need" ] || { echo "$0: $SRC has no $need (submodules checked out?)" >&2; exit 2; }
done
if [ -e "$DEST" ]; then
  echo "$0: $DEST exists; give a new folder" >&2; exit 2
fi
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
[ -x "$CUDA_HOME/bin/nvcc" ] || { echo "$0: no nvcc under CUDA_HOME=$CUDA_HOME (DeepGEMM's JIT needs it)" >&2; exit 2; }

mkdir -p "$DEST"
cp -r "$SRC/deep_gemm" "$DEST/"
# The JIT compiles kernels against headers it finds beside the package.
cp -r "$SRC/third-party/cutlass/include/cute" "$SRC/third-party/cutlass/include/cutlass" "$DEST/deep_gemm/include/"
FLAGS=$($PY - <<'PY'
import sysconfig, torch
from torch.utils import cpp_extension as c
inc = c.include_paths() + [sysconfig.get_paths()["include"]]
libs = c.library_paths()
print(" ".join(["-I" + p for p in inc] + ["-L" + p for p in libs] + ["-Wl,-rpath," + p for p in libs]
      + [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"]))
PY
)
EXT=$($PY -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
echo "building $DEST/deep_gemm/_C$EXT (about a minute)"
start=$SECONDS
${CXX:-c++} -std=c++20 -O2 -fPIC -shared -Wno-psabi -Wno-deprecated-declarations \
  -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H $FLAGS \
  -I"$CUDA_HOME/include" -I"$CUDA_HOME/include/cccl" -I"$SRC/deep_gemm/include" \
  -I"$SRC/third-party/cutlass/include" -I"$SRC/third-party/fmt/include" \
  "$SRC/csrc/python_api.cpp" -o "$DEST/deep_gemm/_C$EXT" \
  -L"$CUDA_HOME/lib64" -lcudart -lnvrtc -lc10 -lc10_cuda -ltorch -ltorch_cpu -ltorch_cuda -ltorch_python
echo "built in $((SECONDS - start)) s; use it with PYTHONPATH=$DEST"
