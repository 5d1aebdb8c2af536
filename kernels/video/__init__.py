"""Video curation kernels (``kernels/video``): probe, shot detection, single-decode clip
extraction with transcoding and filter scores, de-duplication, WebDataset shards.

- :mod:`.sources`: the demo videos that ship in packages; listing a local directory.
- :mod:`.probe`: container/stream facts, or a :class:`~.probe.Rejected` reason.
- :mod:`.detect`: shot detectors behind a registry: ``transnetv2``, ``content``, ``stride``.
- :mod:`.clips`: one decode pass per video: detection, H.264 transcode, filter scores, embeddings.
- :mod:`.dedup`: exact, perceptual-hash and semantic (k-means + cosine) de-duplication.
- :mod:`.shards`: deterministic WebDataset tar shards, manifest as commit point, rank-sharded reader.

References:
    .. [NeMoVideo2025] Z. Patel et al. (NVIDIA). Training Video Foundation Models with NVIDIA NeMo.
       arXiv:2503.12964, 2025 (Sec. 2: the curation pipeline: splitting, transcoding, filtering,
       annotation, de-duplication, sharding).
    .. [Soucek2020] T. Souček, J. Lokoč. TransNet V2: An effective deep network architecture for
       fast shot transition detection. arXiv:2008.04838, 2020.
"""
