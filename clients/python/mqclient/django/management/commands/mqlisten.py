"""manage.py mqlisten: the @mqclient.django.handler functions fed over the websocket instead of
webhooks (for a project the server cannot post to). The same once-only transaction as the
webhook view: a delivery handed again (its ack was lost) runs nothing again."""

from django.core.management.base import BaseCommand, CommandError
from django.db import connections

from mqclient import Client
from mqclient.django import conf, webhooks


class Command(BaseCommand):
    help = "Run the registered mqclient.django handlers on deliveries over the websocket, until SIGTERM."

    def handle(self, *args, **options):
        subscriptions = webhooks.subscriptions()
        if not subscriptions:
            raise CommandError("no handlers: register some with @mqclient.django.handler(queue, event)")

        def on_delivery(delivery):
            # listen() runs this in a thread other than the main one: its connections are
            # that thread's, closed here rather than left behind
            try:
                webhooks.handle(delivery)  # returns: acked; raises: nacked with its words
            finally:
                connections.close_all()

        self.stdout.write(f"mqlisten: {len(subscriptions)} subscription(s), until SIGTERM")
        self.stdout.flush()
        with Client(conf.need("URL"), conf.need("TOKEN"), timeout=conf.get("TIMEOUT_SECS")) as mq:
            mq.listen(on_delivery, subscriptions)
