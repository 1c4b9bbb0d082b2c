"""acco_jax: ACCO (Accumulate while you Communicate) and low-communication training in JAX."""

from acco_jax import families as families
from acco_jax.dp.flat import FlatLayout as FlatLayout
from acco_jax.dp.methods import METHODS as METHODS
from acco_jax.dp.methods import AccoState as AccoState
from acco_jax.dp.methods import CommPlan as CommPlan
from acco_jax.dp.methods import MethodTransformation as MethodTransformation
from acco_jax.dp.methods import WpState as WpState
from acco_jax.dp.methods import acco as acco
from acco_jax.dp.methods import comm_plan as comm_plan
from acco_jax.dp.methods import committed_params as committed_params
from acco_jax.dp.methods import ddp as ddp
from acco_jax.dp.methods import dpu as dpu
from acco_jax.dp.methods import get_method as get_method
from acco_jax.dp.methods import wp as wp
from acco_jax.dp.methods import zero1 as zero1
from acco_jax.dp.step import TrainState as TrainState
from acco_jax.dp.step import TrainStep as TrainStep
from acco_jax.dp.step import make_train_step as make_train_step
from acco_jax.optim import hyperparams as hyperparams

__version__ = "0.1.0"
