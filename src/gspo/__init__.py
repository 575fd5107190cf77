"""gspo: Group Sequence Policy Optimization (Zheng et al., arXiv 2507.18071) for Hugging Face causal LMs."""

import os as _os

# Spin-waiting OpenMP threads make small CPU workloads tens of times slower on small VMs.
# PASSIVE waiting costs nothing measurable on big machines; it only takes effect if set
# before torch loads its OpenMP runtime, so set it as early as we can (users may override).
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
