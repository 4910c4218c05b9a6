"""Plotly figures built from package objects. One module per stage; tests call them directly."""
