"""Scratch-CNN federated paths on raw data: FedAvg, FedOVA, FedABC, Divide-and-Conquer and FedABC's baselines
(local, FedProx, SCAFFOLD, FedPer, FedRep, FedRoD, LG-FedAvg), with optional data sharing (``--share-fraction``).

Independent of the linear-head trainer (``fedhead.core.engine`` / ``heads`` / ``train``) except for SCAFFOLD, which
uses its ``ScaffoldState`` and ``OptimConfig.step_size``: models are trained from scratch on raw images or MFCCs.
Local training is written once (:mod:`.engine`) over member-stacked parameters ``[M, ...]`` (a member is a
client, or a (client, class) pair for FedOVA) and vectorised with ``torch.func.functional_call`` + ``vmap``;
the algorithms (:mod:`.algorithms`) only choose members, losses, trainable layers and the aggregator.
"""
