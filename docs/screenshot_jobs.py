"""Jobs for docs/screenshot.py: short sleeps standing in for real work, and a steady share
of failures so the retry and dead sets fill up while the screenshot is taken."""

import random
import time

import forkq


@forkq.job(queue="images")
def render_thumbnail(image_id: int) -> None:
    time.sleep(random.uniform(0.01, 0.05))


@forkq.job(queue="mail", retry=5)
def send_receipt(order_id: int) -> None:
    time.sleep(random.uniform(0.005, 0.02))
    if order_id % 11 == 0:  # goes to the retry set (first retry 15 s or more later)
        raise ConnectionError(f"smtp.example.com:587 refused the connection for order {order_id}")


@forkq.job(queue="default", retry=0)
def sync_crm(account_id: int) -> None:
    time.sleep(random.uniform(0.005, 0.02))
    if account_id % 17 == 0:  # no retries: straight to the dead set
        raise ValueError(f"account {account_id}: CRM answered 422 Unprocessable Entity")
