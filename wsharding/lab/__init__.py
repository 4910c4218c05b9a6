"""The teaching layer: rank tasks, figures, widget panels, the demo, benchmarks and the command.

Everything here stands on the library (``wsharding.core.layout`` ... ``wsharding.models``) and imports it
only through public names; nothing in the library imports this package. Notebooks call these
modules, and the tests call the same functions the widgets wrap.

* ``tasks``   -- functions that run on every rank of a :class:`~wsharding.lab.cluster.RankCluster`
  (they live in a package because spawned ranks import tasks by module name);
* ``viz``     -- plotly figures of what a task, trace or report holds;
* ``widgets`` -- ipywidgets panels, thin wrappers over ``<stage>_view`` functions;
* ``demo``, ``bench``, ``plan``, ``info`` and ``cli`` -- the ``wsharding`` command.
"""
