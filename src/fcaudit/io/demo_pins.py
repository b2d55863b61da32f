"""SHA-256 of every file of the demo's shipped models (fcaudit/demo_models/).

Written by ``python -m fcaudit.study.demo`` with the files; checked by
:mod:`fcaudit.io.demo_models` before every use. Do not edit by hand.
"""

PINNED: dict[str, dict[str, str]] = {
    'featuregate': {
        'config.json':
            'ef335a4157942cc654ccd039b2b598d9279f1daf49ef8328080b7d27ef0f1eaf',
        'model.safetensors':
            '035e189ec70d98c8918cba6ef39396d80e86a6eeb3af3a5d5a8f525c0a2e62d2',
        'tokenizer.json':
            '82b2238a7dc15b2f7e093df3675065e4aaed27572fd6252aeade7781b382500e',
        'train_log.jsonl':
            'c5e20a5186cdcd430bb376a9a3a548cd7b68cf364c7ebc90ef9dde672dc2ddd9',
    },
    'dense': {
        'config.json':
            '285e9868e5234d2026db9ce7c442defde4360183fdd583c4e28cca7a623715c1',
        'model.safetensors':
            '234b57a101a62c36854c2e4ff6d73eb5d684c68113f0e3774c12a8dfd99af794',
        'tokenizer.json':
            '82b2238a7dc15b2f7e093df3675065e4aaed27572fd6252aeade7781b382500e',
        'train_log.jsonl':
            '1c729045aac6adb68c84a12ffdabb8eca6248496d012348b1edc3e19aa144e7a',
    },
}
