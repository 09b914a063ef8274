"""`keras_dist.plan`: where every variable goes and what each device holds,
from shapes only (`plan`), for a model made and built from a shape (`model`)
on a mesh of any size (`paper_mesh`), with the optimizer's slots (`slots`)
and the swapped-axes rule (`swapped`), as a `Plan` (`result`) shown as a
table or a chart (`report`)."""

from keras_dist.planner.plan import plan
from keras_dist.planner.result import DeviceTotals, Plan, Problem, VariableRow

__all__ = ["DeviceTotals", "Plan", "Problem", "VariableRow", "plan"]
