"""hsbncmp: the parts of examples/compare/hsbn_compare.py (the sync-scope comparison).

  data     Fashion-MNIST from Debian's dataset-fashion-mnist, mosaics, per-node class skew
  models   the small classification CNN and segmentation encoder-decoder (BN after every conv)
  train    one training run: a DDP worker in a LocalCluster, or the one-process reference
  report   the Markdown table, per-layer divergence, plots, JSON and CSV
  cli      flags and the whole comparison
"""
