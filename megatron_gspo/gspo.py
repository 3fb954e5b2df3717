"""Public import path of the GSPO loss API (the math lives in :mod:`megatron_gspo.loss.gspo`).

``from megatron_gspo.gspo import gspo_loss, sequence_log_ratio, group_advantages`` is the
documented entry point and stays valid; the implementation moved to the ``loss`` subpackage.
"""

from megatron_gspo.loss.gspo import *  # noqa: F401,F403
from megatron_gspo.loss.gspo import __all__  # noqa: F401
