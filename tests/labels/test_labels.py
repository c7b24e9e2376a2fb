"""The ImageNet class names shipped with the package (vit_jax/labels/README.md)."""

import zipfile

from vit_jax import labels
from vit_jax.labels import make_label_files


def test_imagenet_1k_names_are_in_the_ilsvrc_label_order():
  names = labels.official_label_names(1000)
  assert len(names) == 1000 and len({n.lower() for n in names}) == 1000
  assert names[:3] == ("tench", "goldfish", "great white shark")
  assert names[999] == "toilet tissue"  # n15075141
  # The classes that share a first lemma: told apart by their second lemma or synset id.
  assert (names[134], names[517]) == ("crane (n02012849)", "crane (n03126707)")
  assert (names[264], names[474]) == ("Cardigan (Cardigan Welsh corgi)", "cardigan")
  assert (names[638], names[639]) == ("maillot", "maillot (tank suit)")


def test_imagenet_21k_names_are_in_the_sorted_synset_order_of_the_official_heads():
  names = labels.official_label_names(21843)
  assert len(names) == 21843 and len({n.lower() for n in names}) == 21843
  assert (names[0], names[-1]) == ("organism", "knothole")  # n00004475, n15102894
  assert (names[359], names[2167], names[2388]) == ("tench", "dog", "domestic cat")
  assert all(n and n == n.strip() for n in names)


def test_other_class_counts_have_no_names():
  assert labels.official_label_names(10) is None
  assert labels.official_label_names(21841) is None


def test_the_generator_names_a_class_by_its_first_lemma_and_tells_duplicates_apart(tmp_path):
  lemmas = {"n1": ["crane"], "n2": ["crane"], "n3": ["maillot"], "n4": ["maillot", "tank suit"],
            "n5": ["tench", "Tinca tinca"], "n6": ["Cardigan", "Cardigan Welsh corgi"],
            "n7": ["cardigan"]}
  assert make_label_files.short_names(list(lemmas), lemmas) == [
      "crane (n1)", "crane (n2)", "maillot", "maillot (tank suit)", "tench",
      "Cardigan (Cardigan Welsh corgi)", "cardigan"]
  # From a zip laid out as the timm wheel: one name per line, in the synset files' order.
  small, large = ([f"n{i:08d}" for i in range(n)] for n in (1000, 21843))
  with zipfile.ZipFile(tmp_path / "timm.whl", "w") as wheel:
    wheel.writestr("timm/data/_info/imagenet_synsets.txt", "\n".join(small) + "\n")
    wheel.writestr("timm/data/_info/imagenet21k_goog_synsets.txt", "\n".join(large))
    wheel.writestr("timm/data/_info/imagenet_synset_to_lemma.txt",
                   "".join(f"{s}\tname {i}, other\n" for i, s in enumerate(large)))
  assert make_label_files.main([str(tmp_path / "timm.whl"), "--out", str(tmp_path)]) == 0
  assert (tmp_path / "imagenet1k.txt").read_text().splitlines() == [
      f"name {i}" for i in range(1000)]
  assert (tmp_path / "imagenet21k.txt").read_text().splitlines()[-1] == "name 21842"
