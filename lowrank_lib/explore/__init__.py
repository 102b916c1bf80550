"""Interactive views behind the notebooks' sliders: what each slider value shows, computed once and cached.

    heads   notebook 04: one head's logit / output errors at EVERY rank from one SVD per basis, the
            last query's top keys under dense, attention-aware and raw rank-r keys, a (layer, head, r)
            explorer
    keep    notebook 00: a keep-ratio explorer over SVD-LLM v1 (one whitened SVD, every keep a slice),
            perplexity and answer cached per keep

The widgets are thin: every number they show comes from a plain function tested without a browser;
``tests/browser/`` drives the widgets themselves in JupyterLab.
"""
