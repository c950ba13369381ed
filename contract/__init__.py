"""The contract between the stream and the models, on its own floor: what the dataset spec and the stream
views offer a model, and what a model version was trained with.

    inputs.py     the models' inputs by name, derived from the spec's tables and the stream views
    examples.py   Examples: what training sets hold and models consume; the scoring frame's layout
    transform.py  feature rows -> Examples, one function for training (offline rows) and serving (online)
    terms.py      the terms a version records (dataset, event types, numeric inputs, token prefixes) and
                  what of them the online features of a server cannot satisfy
"""
