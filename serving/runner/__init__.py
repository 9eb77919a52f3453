"""The model side of a step: the runner (``model_runner``: the model, its L1 pool, the attention
backend), a forward's batch (``forward_batch``), decode and extend CUDA graphs (``cuda_graph``,
``cuda_graph_extend``), sampling (``sampler``) and logprobs (``logprobs``, ``logprob_meta``).
The model definitions and kernels stay in ``serving.models`` and ``serving.kernels`` (they hold
C++ sources and build outputs). Import the modules; this file re-exports nothing.
"""
