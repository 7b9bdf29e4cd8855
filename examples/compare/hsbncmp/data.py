"""Fashion-MNIST (Debian's dataset-fashion-mnist), mosaics for segmentation, and the data plan:
which items every worker sees at every step.

The plan is made once, in the parent process, from the seed; every mode of one seed (and the
one-process reference) trains on exactly the same items in the same order. Each node's workers
see class-skewed data: every class has a home node (classes split into contiguous blocks,
with 2 nodes: 0-4 clothing on node 0, 5-9 shoes and bags on node 1), and with probability
`skew` an item is dealt to its home node, otherwise to a node chosen uniformly.
"""

import gzip
import os
import struct

import numpy as np

DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"
FILES = {
    "train_x": "train-images-idx3-ubyte.gz",
    "train_y": "train-labels-idx1-ubyte.gz",
    "test_x": "t10k-images-idx3-ubyte.gz",
    "test_y": "t10k-labels-idx1-ubyte.gz",
}
CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
           "Bag", "Ankle boot"]
MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST pixel statistics (training set), for input scaling

MOSAIC = 2              # segmentation images are MOSAIC x MOSAIC cells of 28 x 28 items
CELL = 28
SEG_SIZE = MOSAIC * CELL
EMPTY_CELL = 0.25       # probability that a mosaic cell holds no item (only background)
JITTER = 3              # items are shifted by up to this many pixels in x and y
FOREGROUND = 32         # an item's pixel with intensity >= this (of 255) is labelled with its class
SEG_CLASSES = 11        # background + 10 item classes


class DataMissingError(RuntimeError):
    pass


def check_data_dir(data_dir):
    data_dir = data_dir or DEFAULT_DATA_DIR
    missing = [f for f in FILES.values() if not os.path.isfile(os.path.join(data_dir, f))]
    if missing:
        raise DataMissingError(
            "Fashion-MNIST is missing from %s (no %s). Install Debian's package: "
            "`sudo apt-get install dataset-fashion-mnist` (scripts/setup.sh installs it), or "
            "point --data-dir at a folder with the four *-ubyte.gz files."
            % (data_dir, ", ".join(missing)))
    return data_dir


def _read_idx(path):
    with gzip.open(path, "rb") as f:
        raw = f.read()
    magic, = struct.unpack(">I", raw[:4])
    if magic >> 8 != 0x08:  # unsigned byte data
        raise DataMissingError("%s is not an IDX file of unsigned bytes" % path)
    ndim = magic & 0xFF
    dims = struct.unpack(">" + "I" * ndim, raw[4:4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    return data.reshape(dims)


def load(data_dir):
    """{'train_x': uint8[60000,28,28], 'train_y': uint8[60000], 'test_x', 'test_y'}."""
    data_dir = check_data_dir(data_dir)
    return {k: _read_idx(os.path.join(data_dir, f)) for k, f in FILES.items()}


def home_node(labels, nodes):
    return (labels.astype(np.int64) * nodes) // 10


def compose(items_x, items_y, cells, shifts):
    """Mosaics from items. cells: int[M, MOSAIC*MOSAIC] item indices (-1 = empty cell);
    shifts: int[M, MOSAIC*MOSAIC, 2]. Returns uint8 images [M, 56, 56] and uint8 labels
    [M, 56, 56] (0 = background, 1 + class for an item's foreground pixels; where shifted items
    overlap, the later cell's foreground wins)."""
    m = cells.shape[0]
    img = np.zeros((m, SEG_SIZE, SEG_SIZE), np.uint8)
    lab = np.zeros((m, SEG_SIZE, SEG_SIZE), np.uint8)
    for i in range(m):
        for c in range(MOSAIC * MOSAIC):
            item = cells[i, c]
            if item < 0:
                continue
            y0 = (c // MOSAIC) * CELL + shifts[i, c, 0]
            x0 = (c % MOSAIC) * CELL + shifts[i, c, 1]
            # clip the 28x28 item to the canvas
            sy0, sx0 = max(0, -y0), max(0, -x0)
            dy0, dx0 = max(0, y0), max(0, x0)
            dy1, dx1 = min(SEG_SIZE, y0 + CELL), min(SEG_SIZE, x0 + CELL)
            patch = items_x[item, sy0:sy0 + dy1 - dy0, sx0:sx0 + dx1 - dx0]
            fg = patch >= FOREGROUND
            region_img = img[i, dy0:dy1, dx0:dx1]
            region_lab = lab[i, dy0:dy1, dx0:dx1]
            region_img[fg] = patch[fg]
            region_lab[fg] = 1 + int(items_y[item])
            # faint background pixels of the item (below the foreground threshold) stay visible
            # where nothing else is
            faint = (~fg) & (region_img == 0)
            region_img[faint] = patch[faint]
    return img, lab


def random_mosaics(rng, pool, m):
    """Definitions of m mosaics whose items are drawn from `pool` (item indices)."""
    n = MOSAIC * MOSAIC
    cells = pool[rng.integers(0, len(pool), size=(m, n))].astype(np.int64)
    cells[rng.random((m, n)) < EMPTY_CELL] = -1
    shifts = rng.integers(-JITTER, JITTER + 1, size=(m, n, 2))
    return cells, shifts


def training_pool(train_y, train_size):
    """The fixed subset of training items every run draws from (the same for every seed)."""
    n = len(train_y)
    if train_size is None or train_size >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng(12345).permutation(n)[:train_size])


def make_plan(task, seed, train_y, pool, nodes, workers_per_node, batch, epochs, steps, skew):
    """The data order of one seed: for classification int[steps, world, batch] indices into
    the training set; for segmentation a dict of mosaic definitions cells[steps, world, batch,
    4] and shifts[steps, world, batch, 4, 2]. Node n's workers get items of node n's shard
    (class-skewed as described above), reshuffled whenever the node has gone through it."""
    rng = np.random.default_rng([seed, 0 if task == "cls" else 1, 777])
    home = home_node(train_y[pool], nodes)
    to_home = rng.random(len(pool)) < skew
    node_of = np.where(to_home, home, rng.integers(0, nodes, len(pool)))
    shards = [pool[node_of == n] for n in range(nodes)]
    node_batch = workers_per_node * batch
    world = nodes * workers_per_node
    if min(len(s) for s in shards) < node_batch:
        raise ValueError("the training subset is too small for a node batch of %d; raise "
                         "--train-size" % node_batch)
    # An epoch is len(pool) items over the whole job; every node walks through its own shard
    # and reshuffles it when it runs out (the skew makes shards of different sizes), so the
    # number of steps is the same for every seed.
    per_epoch = max(1, len(pool) // (world * batch))
    total = steps if steps else max(1, int(round(epochs * per_epoch)))
    idx = np.empty((total, world, batch), np.int64)
    orders = [rng.permutation(s) for s in shards]
    pos = [0] * nodes
    for step in range(total):
        for n in range(nodes):
            if pos[n] + node_batch > len(orders[n]):
                orders[n], pos[n] = rng.permutation(shards[n]), 0
            chunk = orders[n][pos[n]:pos[n] + node_batch]
            pos[n] += node_batch
            idx[step, n * workers_per_node:(n + 1) * workers_per_node] = chunk.reshape(
                workers_per_node, batch)
    if task == "cls":
        return {"idx": idx, "steps": total, "per_epoch": per_epoch}
    # Segmentation: every training item anchors one mosaic; the other cells are drawn from the
    # same node's shard, so a mosaic is as class-skewed as its node.
    n_cells = MOSAIC * MOSAIC
    cells = np.empty((total, world, batch, n_cells), np.int64)
    shifts = rng.integers(-JITTER, JITTER + 1, size=(total, world, batch, n_cells, 2))
    for r in range(world):
        shard = shards[r // workers_per_node]
        cells[:, r] = shard[rng.integers(0, len(shard), size=(total, batch, n_cells))]
    anchor = rng.integers(0, n_cells, size=(total, world, batch))
    np.put_along_axis(cells, anchor[..., None], idx[..., None], axis=3)
    empty = rng.random(cells.shape) < EMPTY_CELL
    empty[np.arange(n_cells)[None, None, None, :] == anchor[..., None]] = False
    cells[empty] = -1
    return {"cells": cells, "shifts": shifts, "steps": total, "per_epoch": per_epoch}


def test_mosaics(test_x, test_y, count):
    """Fixed segmentation test set built from Fashion-MNIST's test items."""
    rng = np.random.default_rng(2024)
    cells, shifts = random_mosaics(rng, np.arange(len(test_y)), count)
    return compose(test_x, test_y, cells, shifts)


def to_input(u8):
    """uint8 [N, H, W] -> float32 [N, 1, H, W], standardized."""
    x = u8.astype(np.float32) / 255.0
    return ((x - MEAN) / STD)[:, None]
