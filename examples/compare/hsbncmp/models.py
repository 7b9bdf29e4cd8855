"""The two small models of the comparison; BatchNorm after every convolution.

Both are tiny on purpose: eight worker processes share the CPU cores of one machine.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import data


def conv_bn(cin, cout, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True))


class ClassifierCNN(nn.Module):
    """28x28 -> 10 classes: four conv-BN-ReLU blocks (28, 14, 7, 7 px), global pool, linear."""

    def __init__(self, classes=10):
        super().__init__()
        self.c1 = conv_bn(1, 8)
        self.c2 = conv_bn(8, 16, 2)
        self.c3 = conv_bn(16, 32, 2)
        self.c4 = conv_bn(32, 32)
        self.fc = nn.Linear(32, classes)

    def forward(self, x):
        x = self.c4(self.c3(self.c2(self.c1(x))))
        return self.fc(x.mean(dim=(2, 3)))


class SegmenterNet(nn.Module):
    """56x56 mosaic -> per-pixel logits over background + 10 classes. A strided stem (28 px),
    encoder to 7 px, a decoder with skip connections back to 28 px, logits upsampled to 56."""

    def __init__(self, classes=data.SEG_CLASSES):
        super().__init__()
        self.stem = conv_bn(1, 8, 2)      # 28
        self.e2 = conv_bn(8, 16, 2)       # 14
        self.e3 = conv_bn(16, 32, 2)      # 7
        self.e4 = conv_bn(32, 32)         # 7
        self.d2 = conv_bn(32 + 16, 16)    # 14
        self.d1 = conv_bn(16 + 8, 16)     # 28
        self.head = nn.Conv2d(16, classes, 1)

    def forward(self, x):
        s = self.stem(x)
        e2 = self.e2(s)
        e = self.e4(self.e3(e2))
        d = self.d2(torch.cat([F.interpolate(e, scale_factor=2.0, mode="nearest"), e2], 1))
        d = self.d1(torch.cat([F.interpolate(d, scale_factor=2.0, mode="nearest"), s], 1))
        return F.interpolate(self.head(d), scale_factor=2.0, mode="bilinear",
                             align_corners=False)


class GrayToRGB(nn.Module):
    """A torchvision classifier on Fashion-MNIST's 1-channel 28x28 items: the channel repeated
    three times (torchvision's models take RGB), the model unchanged otherwise."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x.expand(-1, 3, -1, -1))


class UnknownModel(ValueError):
    pass


def torchvision_names():
    """The classifiers torchvision offers by name (torchvision.models.<name>(num_classes=...))."""
    import torchvision
    lister = getattr(torchvision.models, "list_models", None)
    if lister is not None:
        return sorted(lister(module=torchvision.models))
    return sorted(n for n in dir(torchvision.models) if n[:1].islower() and not n.startswith("_")
                  and callable(getattr(torchvision.models, n)))


def torchvision_model(name, classes=10):
    """torchvision.models.<name>, randomly initialized (weights=None: nothing is downloaded),
    with `classes` outputs, on gray 28x28 input. Needs Debian's python3-torchvision."""
    try:
        import torchvision
    except ImportError:
        raise UnknownModel("--model %s needs torchvision: apt-get install python3-torchvision "
                           "(scripts/packages.txt has it)" % name) from None
    if name not in torchvision_names():
        raise UnknownModel("--model %r: torchvision %s has no classifier of that name; "
                           "e.g. resnet18, resnet50, mobilenet_v3_small, efficientnet_b0"
                           % (name, torchvision.__version__))
    return GrayToRGB(getattr(torchvision.models, name)(num_classes=classes))


def build(task, model=None):
    """The task's model: the small built-in one, or with `model` a torchvision classifier by
    name (classification only)."""
    if model:
        if task != "cls":
            raise UnknownModel("--model applies to classification (--task cls)")
        return torchvision_model(model)
    return ClassifierCNN() if task == "cls" else SegmenterNet()


def parameter_count(task, model=None):
    return sum(p.numel() for p in build(task, model).parameters())
