"""The marks of a test that compiles for an abstract GPU through the CUDA PJRT plugin: ``.ci/run``
installs the plugin after the README's test command and runs ``pytest -m cuda_plugin``; without it
these tests skip and say why."""

import pytest

from acco_jax import parallel

NEEDS_PLUGIN = pytest.mark.skipif(
  not parallel.has_cuda_plugin(),
  reason='needs the CUDA PJRT plugin: pip install "jax-cuda12-pjrt==<jaxlib version>"',
)
MARKS = [pytest.mark.cuda_plugin, NEEDS_PLUGIN]
