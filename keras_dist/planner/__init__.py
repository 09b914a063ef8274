"""`keras_dist.plan`: where every variable goes and what each device holds,
from shapes only (`plan`), for a model made and built from a shape (`model`)
on a mesh of any size (`paper_mesh`), with the optimizer's slots (`slots`)
and the swapped-axes rule (`distribution.swapped_axes`), as a `Plan`
(`result`) shown as a table or a chart (`report`); `plan_search` compiles
candidate distributions for a topology and ranks them (`search`,
`candidates`, `search_cache`, `search_result`)."""

from keras_dist.planner.candidates import Candidate
from keras_dist.planner.plan import plan
from keras_dist.planner.result import DeviceTotals, Plan, Problem, VariableRow
from keras_dist.planner.search import plan_search
from keras_dist.planner.search_result import SearchResult, SearchResults

__all__ = [
    "Candidate",
    "DeviceTotals",
    "Plan",
    "Problem",
    "SearchResult",
    "SearchResults",
    "VariableRow",
    "plan",
    "plan_search",
]
