"""The one engine: a run is a layer *source* -> the per-layer functions of its stages -> a layer *sink*.

- `layers`: what a method's per-layer function sees of one decoder layer (`LayerJob`), and the walk's
  primitives (capturing layer 0's inputs, running a layer over its inputs, computing in a lower dtype);
- `onepass`: group-sequential solving in one pass over the calibration windows;
- `compose`: several stages' per-layer functions as one (layer i gets every stage before layer i+1);
- `walk`: the loop over the layers, from a source to a sink, resumable.
"""
