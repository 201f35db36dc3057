"""Scratch-CNN federated paths: FedAvg, FedOVA, FedABC and Divide-and-Conquer on raw data.

Independent of the linear-head trainer (``fedhead.engine`` / ``heads`` / ``train``): models are trained
from scratch on raw images or MFCCs. Local training is written once (:mod:`.engine`) over
member-stacked parameters ``[M, ...]`` (a member is a client, or a (client, class) pair for FedOVA)
and vectorised with ``torch.func.functional_call`` + ``vmap``; the algorithms (:mod:`.algorithms`)
only choose members, losses, trainable layers and the aggregator.
"""
