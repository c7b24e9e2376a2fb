"""Tests of loading PyTorch ``.pth.tar`` checkpoints without torch (vit_jax.checkpoint.load_pth,
load(path, model=...), vit_jax.checkpoint.torch_pickle): golden T2T-ViT logits, refusal of
malicious pickles, hand-written torch-layout zips (module. prefix, strides, dtypes, byte order),
legacy/missing files.
"""

import argparse
import collections
import functools
import io
import os
import pathlib
import pickle
import pickletools
import struct
import zipfile

import jax
import ml_dtypes
import numpy as np
import pytest

from tests import t2t_fixtures
from vit_jax import checkpoint
from vit_jax import models
from vit_jax.checkpoint import torch_pickle

# Outputs compared with the reference implementations' fixtures: highest matmul precision.
pytestmark = pytest.mark.golden

FIXTURES = pathlib.Path(__file__).parents[1] / 'fixtures'
GOLDEN = ('t2t_tiny_performer', 't2t_tiny_transformer')
RTOL = ATOL = 1e-5


# ------------------------------------------------------------------------------------------------
# Helpers: fixture models, and a writer of torch zip-format files that needs no torch.
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _golden_model(name):
  kwargs = dict(t2t_fixtures.constructor_kwargs(name))
  kwargs.pop('img_size')
  num_classes = kwargs.pop('num_classes')
  return models.create('T2T-ViT-custom', num_classes=num_classes, **kwargs)


@functools.lru_cache(maxsize=None)
def _jitted_apply(model):
  return jax.jit(lambda variables, images: model.apply(variables, images, train=False))


def _logits(model, variables, name):
  inputs = np.load(FIXTURES / name / 'inputs_nhwc.npy', allow_pickle=False)
  with jax.default_matmul_precision('highest'):
    return np.asarray(_jitted_apply(model)(variables, inputs))


def _reference_state_dict(name):
  with np.load(FIXTURES / name / 'state_dict_ema.npz', allow_pickle=False) as f:
    return {k: f[k] for k in f.files}


class _Global:
  """Makes the pure-Python pickler write ``GLOBAL module name`` without importing ``module``."""

  def __init__(self, module, name):
    self.module, self.name = module, name

  def __call__(self, *args):  # save_reduce requires a callable.
    raise AssertionError('never called')


_STORAGE_NAMES = {
    np.dtype(np.float32): 'FloatStorage', np.dtype(np.float16): 'HalfStorage',
    np.dtype(ml_dtypes.bfloat16): 'BFloat16Storage', np.dtype(np.float64): 'DoubleStorage',
    np.dtype(np.int64): 'LongStorage', np.dtype(np.int32): 'IntStorage',
    np.dtype(np.int16): 'ShortStorage', np.dtype(np.int8): 'CharStorage',
    np.dtype(np.uint8): 'ByteStorage', np.dtype(np.bool_): 'BoolStorage',
}


class _Store:
  """A 1-D storage written to ``data/<key>``."""

  def __init__(self, flat, key):
    self.array, self.key = np.ascontiguousarray(flat).reshape(-1), key


class _Tensor:
  """Pickles as ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, False, {})``."""

  def __init__(self, store, offset, size, stride):
    self.store, self.offset, self.size, self.stride = store, offset, tuple(size), tuple(stride)

  def __reduce__(self):
    return (_Global('torch._utils', '_rebuild_tensor_v2'),
            (self.store, self.offset, self.size, self.stride, False, collections.OrderedDict()))


class _TorchPickler(pickle._Pickler):  # pylint: disable=protected-access
  """Writes what torch.save's pickler writes for tensors (protocol 2, persistent storages)."""

  dispatch = pickle._Pickler.dispatch.copy()  # pylint: disable=protected-access

  def _save_global_marker(self, obj):
    self.write(pickle.GLOBAL + f'{obj.module}\n{obj.name}\n'.encode('ascii'))

  dispatch[_Global] = _save_global_marker

  def persistent_id(self, obj):
    if isinstance(obj, _Store):
      storage = _Global('torch', _STORAGE_NAMES[obj.array.dtype])
      return ('storage', storage, obj.key, 'cpu', obj.array.size)
    return None


def _tensors(arrays):
  """Replaces every array in a (nested) dict by a contiguous _Tensor with its own storage."""
  counter = iter(range(10**6))

  def convert(value):
    if isinstance(value, dict):
      return type(value)((k, convert(v)) for k, v in value.items())
    if isinstance(value, np.ndarray):
      strides = [int(np.prod(value.shape[i + 1:])) for i in range(value.ndim)]
      return _Tensor(_Store(value, str(next(counter))), 0, value.shape, strides)
    return value

  return convert(arrays)


def _collect_stores(obj, found):
  if isinstance(obj, _Tensor):
    found[obj.store.key] = obj.store
  elif isinstance(obj, dict):
    for v in obj.values():
      _collect_stores(v, found)
  elif isinstance(obj, (list, tuple)):
    for v in obj:
      _collect_stores(v, found)
  return found


def _write_torch_zip(path, obj, *, prefix='archive', byteorder='little', data_pkl=None):
  """Writes ``obj`` (with _Tensor leaves) in torch.save's zip layout; or a given data.pkl."""
  if data_pkl is None:
    buffer = io.BytesIO()
    _TorchPickler(buffer, protocol=2).dump(obj)
    data_pkl = buffer.getvalue()
  stores = _collect_stores(obj, {}) if obj is not None else {}
  with zipfile.ZipFile(path, 'w', zipfile.ZIP_STORED) as z:
    z.writestr(f'{prefix}/data.pkl', data_pkl)
    z.writestr(f'{prefix}/byteorder', byteorder)
    for key, store in stores.items():
      array = store.array
      if byteorder != 'little':
        array = array.view(f'u{array.dtype.itemsize}').astype(f'>u{array.dtype.itemsize}')
      z.writestr(f'{prefix}/data/{key}', array.tobytes())
    z.writestr(f'{prefix}/version', '3\n')
  return path


# ------------------------------------------------------------------------------------------------
# The golden fixtures.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize('name', GOLDEN)
def test_load_reproduces_ema_logits(name):
  model = _golden_model(name)
  variables = checkpoint.load(FIXTURES / name / 'checkpoint.pth.tar', model=model)
  assert set(variables) == {'params', 'constants'}
  expected = np.load(FIXTURES / name / 'logits.npy', allow_pickle=False)
  np.testing.assert_allclose(_logits(model, variables, name), expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize('name', GOLDEN)
def test_load_state_dict_entry_with_use_ema_false(name):
  model = _golden_model(name)
  variables = checkpoint.load(str(FIXTURES / name / 'checkpoint.pth.tar'), model=model,
                              use_ema=False)
  logits = _logits(model, variables, name)
  np.testing.assert_allclose(
      logits, np.load(FIXTURES / name / 'logits_state_dict.npy', allow_pickle=False),
      rtol=RTOL, atol=ATOL)
  assert not np.allclose(logits, np.load(FIXTURES / name / 'logits.npy'), atol=1e-2)


@pytest.mark.parametrize('name', GOLDEN)
def test_load_pth_equals_reference_npz(name):
  state_dict = checkpoint.load_pth(FIXTURES / name / 'checkpoint.pth.tar')
  reference = _reference_state_dict(name)
  assert list(state_dict) == list(reference)
  for key, value in reference.items():
    assert type(state_dict[key]) is np.ndarray
    assert state_dict[key].dtype == value.dtype and state_dict[key].shape == value.shape, key
    np.testing.assert_array_equal(state_dict[key], value, err_msg=key)
    assert state_dict[key].flags.c_contiguous and state_dict[key].flags.writeable


def test_full_checkpoint_contents():
  obj = torch_pickle.load_torch_zip(str(FIXTURES / GOLDEN[0] / 'checkpoint.pth.tar'))
  assert list(obj) == ['epoch', 'arch', 'state_dict', 'version', 'state_dict_ema', 'metric']
  assert obj['epoch'] == 0 and obj['arch'] == 't2t_vit' and obj['metric'] == 0.0
  ema, raw = obj['state_dict_ema'], obj['state_dict']
  assert isinstance(ema, collections.OrderedDict) and list(ema) == list(raw)
  assert not np.array_equal(ema['head.weight'], raw['head.weight'])
  np.testing.assert_array_equal(ema['pos_embed'], raw['pos_embed'])


def test_load_torch_without_model_explains():
  path = FIXTURES / GOLDEN[0] / 'checkpoint.pth.tar'
  with pytest.raises(ValueError, match=r'model=.*load_pth'):
    checkpoint.load(path)
  with pytest.raises(ValueError, match='T2T-ViT'):
    checkpoint.load(path, model=models.create('ViT-Ti_16', num_classes=10))


def test_load_wrong_model_lists_mismatch():
  with pytest.raises(ValueError, match='does not fit the model'):
    checkpoint.load(FIXTURES / 't2t_tiny_performer' / 'checkpoint.pth.tar',
                    model=_golden_model('t2t_tiny_transformer'))


def test_npz_still_loads_and_ignores_model(tmp_path):
  path = tmp_path / 'x.npz'
  np.savez(path, **{'head/kernel': np.ones((2, 3), np.float32)})
  out = checkpoint.load(path, model=_golden_model(GOLDEN[0]))
  np.testing.assert_array_equal(out['params']['head']['kernel'], np.ones((2, 3)))


# ------------------------------------------------------------------------------------------------
# Malicious pickles: refused, nothing executed.
# ------------------------------------------------------------------------------------------------

_TRIPWIRE_HITS = []


def _tripwire(*args):
  _TRIPWIRE_HITS.append(args)
  return 'tripped'


class _EvilSystem:

  def __init__(self, marker):
    self.marker = marker

  def __reduce__(self):
    return (os.system, (f'touch {self.marker}',))


class _EvilEval:

  def __init__(self, marker):
    self.marker = marker

  def __reduce__(self):
    return (eval, (f'__import__("pathlib").Path({str(self.marker)!r}).touch()',))


class _EvilLocal:

  def __reduce__(self):
    return (_tripwire, ('called',))


@pytest.mark.parametrize('evil, forbidden', [
    (_EvilSystem, f'{os.system.__module__}.system'),
    (_EvilEval, 'builtins.eval'),
    (lambda marker: _EvilLocal(), f'{__name__}._tripwire'),
])
def test_malicious_pickle_is_refused_without_running(tmp_path, evil, forbidden):
  marker = tmp_path / 'tripwire'
  payload = collections.OrderedDict(
      epoch=1, state_dict_ema={'head.weight': evil(marker)}, state_dict={})
  data_pkl = pickle.dumps(payload, protocol=2)
  module, name = forbidden.rsplit('.', 1)
  written = {f'{module} {name}', f'__builtin__ {name}' if module == 'builtins' else None}
  assert any(op.name == 'GLOBAL' and arg in written
             for op, arg, _ in pickletools.genops(data_pkl))  # The payload is really there.
  path = _write_torch_zip(tmp_path / 'evil.pth.tar', None, data_pkl=data_pkl)
  message = f'refusing to unpickle {forbidden}: only tensors and plain containers are loaded'
  with pytest.raises(torch_pickle.UnsafePickleError, match=message.replace('.', r'\.')):
    checkpoint.load_pth(path)
  with pytest.raises(pickle.UnpicklingError, match='refusing to unpickle'):
    checkpoint.load(path, model=_golden_model(GOLDEN[0]))
  with pytest.raises(torch_pickle.UnsafePickleError):
    torch_pickle.load_torch_zip(str(path))
  assert not marker.exists()
  assert not _TRIPWIRE_HITS


def test_whitelisted_objects_cannot_be_modified(tmp_path):
  # GLOBAL torch FloatStorage; {'_dtype': 'object'}; BUILD -> would poison later loads.
  def unicode(s):
    return b'X' + struct.pack('<I', len(s)) + s.encode()
  data_pkl = (b'\x80\x02ctorch\nFloatStorage\n}' + unicode('_dtype') + unicode('object') +
              b'sb.')
  path = _write_torch_zip(tmp_path / 'poison.pth', None, data_pkl=data_pkl)
  with pytest.raises(pickle.UnpicklingError):
    torch_pickle.load_torch_zip(str(path))
  slot_pkl = (b'\x80\x02ctorch._utils\n_rebuild_tensor_v2\nN}' + unicode('__defaults__') +
              b')s\x86b.')
  path = _write_torch_zip(tmp_path / 'poison2.pth', None, data_pkl=slot_pkl)
  with pytest.raises(pickle.UnpicklingError):
    torch_pickle.load_torch_zip(str(path))
  # Still loads normally afterwards.
  assert checkpoint.load_pth(FIXTURES / GOLDEN[0] / 'checkpoint.pth.tar')['head.weight'].dtype == (
      np.float32)


# ------------------------------------------------------------------------------------------------
# Hand-written torch-layout files.
# ------------------------------------------------------------------------------------------------


def test_module_prefixed_plain_state_dict_with_views(tmp_path):
  name = 't2t_tiny_transformer'
  reference = _reference_state_dict(name)
  shared_keys = [k for k in reference if k.endswith('.bias')][:3]
  shared = _Store(np.concatenate([reference[k] for k in shared_keys]), 'shared')
  state = collections.OrderedDict()
  offset = 0
  for i, (key, value) in enumerate(reference.items()):
    if key in shared_keys:  # Three tensors viewing one storage at offsets.
      state['module.' + key] = _Tensor(shared, offset, value.shape, (1,))
      offset += value.size
    elif value.ndim == 2:  # Stored transposed: a non-contiguous (column-major) view.
      store = _Store(np.ascontiguousarray(value.T), f'{i}')
      state['module.' + key] = _Tensor(store, 0, value.shape, (1, value.shape[0]))
    else:
      state['module.' + key] = _tensors({'x': value})['x']
      state['module.' + key].store.key = f'{i}'
  path = _write_torch_zip(tmp_path / 'plain.pth', state, prefix='plain')

  loaded = checkpoint.load_pth(path)
  assert list(loaded) == list(reference)
  for key, value in reference.items():
    np.testing.assert_array_equal(loaded[key], value, err_msg=key)
    assert loaded[key].flags.c_contiguous
  model = _golden_model(name)
  variables = checkpoint.load(path, model=model)
  np.testing.assert_allclose(_logits(model, variables, name),
                             np.load(FIXTURES / name / 'logits.npy'), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize('byteorder', ['little', 'big'])
def test_dtypes_values_and_byteorder(tmp_path, byteorder):
  rng = np.random.default_rng(0)
  arrays = {
      'f32': rng.standard_normal((2, 3)).astype(np.float32),
      'f16': rng.standard_normal((4,)).astype(np.float16),
      'bf16': rng.standard_normal((3, 2)).astype(ml_dtypes.bfloat16),
      'f64': rng.standard_normal((2, 2, 2)),
      'i64': np.arange(-3, 3, dtype=np.int64),
      'i32': np.arange(6, dtype=np.int32).reshape(2, 3),
      'i16': np.array([-2, 7], np.int16),
      'i8': np.array([-1, 5], np.int8),
      'u8': np.array([0, 255], np.uint8),
      'bool': np.array([True, False, True]),
      'scalar': np.array(2.5, np.float32),
      'empty': np.zeros((0, 3), np.float32),
  }
  payload = {
      'state_dict': _tensors(arrays),
      'args': argparse.Namespace(model='t2t_vit_14', lr=1e-3, drop=None, img_size=(224, 224)),
      'misc': [1, 2.0, 'three', b'four', {5, 6}, frozenset([7]), complex(1, 2), (None, True)],
      'optimizer': {'state': {0: {'step': 3}}, 'param_groups': [{'lr': 0.1, 'params': [0]}]},
  }
  path = _write_torch_zip(tmp_path / 'dtypes.pt', payload, byteorder=byteorder)
  obj = torch_pickle.load_torch_zip(str(path))
  for key, value in arrays.items():
    assert obj['state_dict'][key].dtype == value.dtype, key
    assert obj['state_dict'][key].shape == value.shape, key
    np.testing.assert_array_equal(obj['state_dict'][key], value, err_msg=key)
  assert obj['args'] == torch_pickle.Namespace(model='t2t_vit_14', lr=1e-3, drop=None,
                                               img_size=(224, 224))
  assert obj['args'].model == 't2t_vit_14'
  assert obj['misc'] == payload['misc']
  assert obj['optimizer'] == payload['optimizer']
  # use_ema with no state_dict_ema falls back to state_dict.
  assert list(checkpoint.load_pth(path)) == list(arrays)


def test_out_of_bounds_tensor_record_is_refused(tmp_path):
  store = _Store(np.arange(4, dtype=np.float32), '0')
  path = _write_torch_zip(tmp_path / 'oob.pth',
                          {'state_dict': {'w': _Tensor(store, 1, (2, 2), (2, 1))}})
  with pytest.raises(pickle.UnpicklingError,
                     match="would reach element 4 of storage '0', which holds 4"):
    checkpoint.load_pth(path)


def test_no_state_dict_lists_top_level_keys(tmp_path):
  path = _write_torch_zip(tmp_path / 'other.pth', {'epoch': 3, 'model_weights': [1, 2]})
  with pytest.raises(ValueError, match=r"top-level keys: \['epoch', 'model_weights'\]"):
    checkpoint.load_pth(path)
  with pytest.raises(ValueError, match='no state dict'):
    checkpoint.load_pth(path, use_ema=False)


# ------------------------------------------------------------------------------------------------
# Legacy, non-torch and missing files.
# ------------------------------------------------------------------------------------------------


def test_legacy_format_is_refused(tmp_path):
  # The legacy format starts with the pickled magic number 0x1950a86a20f9469cfc6c.
  path = tmp_path / 'legacy.pth.tar'
  path.write_bytes(pickle.dumps(0x1950a86a20f9469cfc6c, protocol=2) +
                   pickle.dumps(1001, protocol=2))
  for call in (checkpoint.load_pth, lambda p: checkpoint.load(p, model=_golden_model(GOLDEN[0]))):
    with pytest.raises(ValueError, match=r'legacy torch serialization format.*Re-save it'):
      call(path)
  # A pickle under another name is recognised by its content too.
  other = tmp_path / 'weights.bin'
  other.write_bytes(path.read_bytes())
  with pytest.raises(torch_pickle.LegacyTorchFormatError):
    checkpoint.load(other, model=_golden_model(GOLDEN[0]))


def test_non_torch_zip_is_refused_by_load_pth(tmp_path):
  path = tmp_path / 'x.pth'
  np.savez(open(path, 'wb'), a=np.zeros(2))
  with pytest.raises(ValueError, match='expected one "<name>/data.pkl" entry'):
    checkpoint.load_pth(path)


def test_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError):
    checkpoint.load_pth(tmp_path / 'missing.pth.tar')
  with pytest.raises(FileNotFoundError):
    checkpoint.load(tmp_path / 'missing.pth.tar', model=_golden_model(GOLDEN[0]))
