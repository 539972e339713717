"""An app whose periodic entry names a time zone that does not exist: `forkq start` and
`forkq cron` must refuse it in one line (tests/test_cron.py)."""

import forkq

forkq.periodic("0 3 * * *", "Reports::Nightly", tz="Europe/Pariss", name="nightly-report")
