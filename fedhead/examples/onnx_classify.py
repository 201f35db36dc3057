"""Classify images with a model exported by ``fedhead export --format onnx``, without fedhead (docs/model.md).

Needs only numpy, Pillow and onnxruntime: what a client device runs. The file takes uint8 images [N, H, W, 3] at the
size it was exported for and returns logits and probabilities; its metadata holds the class names.

    python fedhead/examples/onnx_classify.py MODEL.onnx FOLDER      # FOLDER/<class>/<file> also prints the accuracy
"""

import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image

SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"}


def classify(model: str, folder: str, batch: int = 64) -> tuple[list[str], list[str], np.ndarray]:
    """The image paths below ``folder``, the class each is predicted to be, and the probabilities [N, C]."""
    import onnxruntime as ort  # here, so that importing this file (fedhead demo does) needs no onnxruntime

    sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    classes = json.loads(sess.get_modelmeta().custom_metadata_map["classes"])
    _, h, w, _ = sess.get_inputs()[0].shape
    paths = sorted(str(p) for p in Path(folder).rglob("*") if p.suffix.lower() in SUFFIXES and p.is_file())
    names, probs = [], []
    for i in range(0, len(paths), batch):
        images = []
        for p in paths[i : i + batch]:
            with Image.open(p) as im:
                images.append(np.asarray(im.convert("RGB").resize((w, h)) if im.size != (w, h) else im.convert("RGB")))
        logits, p = sess.run(["logits", "probabilities"], {"images": np.stack(images)})
        names += [classes[c] for c in logits.argmax(1)]  # the decision is the argmax of the logits
        probs.append(p)
    return paths, names, np.concatenate(probs) if probs else np.zeros((0, len(classes)), np.float32)


if __name__ == "__main__":
    paths, names, _ = classify(sys.argv[1], sys.argv[2])
    truth = [Path(p).parent.name for p in paths]
    for p, n in list(zip(paths, names))[:5]:
        print(p, n)
    correct = sum(t == n for t, n in zip(truth, names))
    print(f"accuracy {correct / max(1, len(paths)):.4f} ({correct} of {len(paths)}) if the folders are the classes")
