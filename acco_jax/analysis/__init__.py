"""Reading compiled programs and modelling their cost: tools for tests and benchmarks.

``hlo`` reads a compiled module (collectives and their bytes, the async schedule on GPU, GEMM
dtypes); ``dataflow`` walks a jaxpr (which collectives a loop feeds or waits on); ``perfmodel`` and
``perfmodel_quantized`` model a step's time from compute and alpha-beta ring communication;
``timeline`` draws a simulated pipeline iteration node by node (matplotlib, imported when drawing).
Pure: nothing here runs a step or moves data; the training code never imports this folder.
"""
