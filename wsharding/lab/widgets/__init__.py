"""ipywidgets panels for the notebooks: each a thin wrapper over a package function that tests
call directly. One module per stage."""
