"""omni_cache.core must stay engine-independent: importing it pulls in no vllm / vllm_omni."""

import subprocess
import sys
from pathlib import Path

CHECK = (
    "import sys; import omni_cache.core; "
    "assert not any(m.split('.')[0] in ('vllm','vllm_omni') for m in sys.modules), "
    "sorted(m for m in sys.modules if m.split('.')[0] in ('vllm','vllm_omni'))"
)


def test_core_imports_no_engine():
    subprocess.run([sys.executable, "-c", CHECK], check=True, cwd=Path(__file__).parents[2])
