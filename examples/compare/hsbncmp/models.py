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


def build(task):
    return ClassifierCNN() if task == "cls" else SegmenterNet()


def parameter_count(task):
    return sum(p.numel() for p in build(task).parameters())
