"""The machinery behind the lesson files: command lines, run directories, file formats, kernels.
A reader of the recipe (train.py, model.py, data.py, freeze.py, eval.py) may skip this folder."""
