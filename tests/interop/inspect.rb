# Read what a shared Redis holds through Ruby Sidekiq 6.4.1's own API (sidekiq/api), as a
# Sidekiq user's console, Web UI or monitoring would, and print it as one JSON object;
# optionally act first, as those do. For the fleet interop tests.
#
#   REDIS_URL=redis://127.0.0.1:PORT/0 ruby inspect.rb [ACTION ...]
#
# ACTION: quiet:IDENTITY or stop:IDENTITY (Sidekiq::Process#quiet! / #stop!),
# clear-queue:NAME (Sidekiq::Queue#clear), clear-schedule (Sidekiq::ScheduledSet#clear).
# Any exception the API raises fails the script (exit 1, the backtrace on stderr).
require "json"
require "sidekiq"
require "sidekiq/api"

ARGV.each do |action|
  verb, arg = action.split(":", 2)
  case verb
  when "quiet", "stop"
    process = Sidekiq::ProcessSet.new.find { |p| p.identity == arg }
    abort("no process #{arg} in Sidekiq::ProcessSet") unless process
    verb == "quiet" ? process.quiet! : process.stop!
  when "clear-queue" then Sidekiq::Queue.new(arg).clear
  when "clear-schedule" then Sidekiq::ScheduledSet.new.clear
  else abort("unknown action #{action}")
  end
end

def entry(e)
  {"jid" => e.jid, "class" => e.klass, "display_class" => e.display_class,
   "display_args" => e.display_args, "queue" => e.queue, "at" => e.respond_to?(:at) ? e.at.to_f : nil,
   "enqueued_at" => e.enqueued_at&.to_f, "created_at" => e.created_at.to_f,
   "error_class" => e["error_class"], "error_message" => e["error_message"],
   "retry_count" => e["retry_count"], "failed_at" => e["failed_at"], "retried_at" => e["retried_at"],
   "error_backtrace" => e.error_backtrace, "item" => e.item}
end

stats = Sidekiq::Stats.new
out = {
  "stats" => %w[processed failed enqueued scheduled_size retry_size dead_size processes_size
                workers_size default_queue_latency].to_h { |m| [m, stats.public_send(m)] },
  "processes" => Sidekiq::ProcessSet.new.map do |p|
    %w[identity hostname pid tag concurrency busy beat quiet queues labels started_at]
      .to_h { |k| [k, p[k]] }.merge("stopping" => p.stopping?)
  end,
  "workers" => Sidekiq::Workers.new.map do |process, tid, work|
    job = Sidekiq::JobRecord.new(work["payload"])
    {"process" => process, "tid" => tid, "queue" => work["queue"], "run_at" => work["run_at"],
     "jid" => job.jid, "class" => job.display_class, "args" => job.display_args}
  end,
  "queues" => Sidekiq::Queue.all.to_h { |q| [q.name, {"size" => q.size, "latency" => q.latency}] },
  "retry" => Sidekiq::RetrySet.new.map { |e| entry(e) },
  "dead" => Sidekiq::DeadSet.new.map { |e| entry(e) },
  "scheduled" => Sidekiq::ScheduledSet.new.map { |e| entry(e) },
}
puts JSON.generate(out)
