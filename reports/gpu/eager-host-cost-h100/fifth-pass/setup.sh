python3 -m pip install -q --no-deps .carry/wheels/*.whl 2>&1 | grep -v WARNING
python3 -c "import pyarrow" 2>/dev/null || python3 -m pip install -q --no-deps .carry/pyarrow/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 DETAUDIT_HOME=$PWD/.carry/home NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
git rev-parse --short HEAD 2>/dev/null; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
python3 -m pip install -q --no-deps .carry/pyspy/*.whl 2>&1 | grep -v WARNING; which py-spy
